"""Group advantages and the policy-gradient loss of one step (the GRPO family), read top to bottom.

One decoupled form for every trained token (Hilton et al. 2021, "Batch size-invariance for policy optimization",
as AReaL trains asynchronously), whichever policy version sampled it:
  w = min(exp(logp_prox - logp_sampled), truncated_importance_sampling)   behaviour weight, no gradient (TIS)
      sign_aware (TOPR): clamp(rho, 1, cap) where A > 0 (never discounting a stale good sample), min(rho, cap) else
  r = exp(logp_new - logp_prox)                                           proximal ratio (GSPO: the trajectory's)
  grpo:   -min(r*A, clip(r, 1-epsilon, 1+epsilon_high)*A) * w   (PPO clip; epsilon_high > epsilon is DAPO)
  gspo:   the same with r = exp(mean of the trajectory's log-ratios); clip 3e-4 / 4e-4, sequence normalization
  cispo:  -sg(clip(r, 1-epsilon, 1+epsilon_high)) * A * logp_new * w   (no lower clip, upper 4, by default)
  beta:   + beta * k3 per token, k3 = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1 (ref = adapter off).
A is the token's group advantage: its trajectory's, or with per-role rewards (`trajectory.rewards_by_role`) its
role's among the group's rewards for that role (see `role_advantages`). logp_prox is the trainer's policy before
this step, logp_sampled what the engine sampled with: a token of the current version (synchronous training,
where only the sampler's numerics differ) and one sampled k versions ago get the same formula, so a step on fresh
rollouts is the synchronous step exactly, and `staleness` changes only the metrics.

Simplifications, and why:
  1. One optimizer update per step: logp_prox is this forward pass, detached, so r = 1 in value and the clip
     bounds nothing; w carries every correction (sampler numerics and staleness alike). The clip acts for a caller
     that passes another proximal policy (`proximal_logprobs`), and the variants differ only in normalization then.
  2. w is truncated above, never clipped below, and is 1 where the sampled logprob is unknown or of a distribution
     the trainer does not reproduce (NaN: top_p, guided decoding, penalties, greedy; see tokenize.excluded_reason).
  3. No value function and no KL in the reward: advantages are group-relative, the KL is a loss term.
Normalization: "token" sums the step's per-token losses and divides by the step's trained tokens; "sequence"
averages each trajectory's tokens, then averages over the step's trajectories (a trajectory whose template rewrote
history and trains as several rows is still one). Both use step totals, so splitting a step into micro-batches
leaves its gradient unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..trajectories import Trajectory


class RewardError(ValueError):
    """A reward that cannot be trained on (NaN or infinite)."""


def total_reward(trajectory: Trajectory, terminal: float | None = None) -> float:
    """The trajectory's reward (or `terminal`: a role's) plus its calls' own rewards (`LLMCall.reward`): what one
    advantage per trajectory trains on. Exactly `trajectory.reward` (`terminal`) when no call has a reward."""
    reward = trajectory.reward if terminal is None else terminal
    calls = [call.reward for call in trajectory.llm_calls if call.reward is not None]
    return reward + math.fsum(calls) if calls else reward


def group_advantages(
    rewards: Sequence[float], *, scale_rewards: bool = True, group_index: int = 0
) -> list[float] | None:
    """reward - group mean (/ group std when `scale_rewards`; off is Dr. GRPO). None when all rewards are equal."""
    for i, reward in enumerate(rewards):
        if not math.isfinite(reward):
            raise RewardError(
                f"group {group_index}, trajectory {i}: reward is {reward}; rewards must be finite"
            )
    if len(rewards) < 2:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std <= 1e-8 * max(1.0, abs(mean)):
        return None
    return [(r - mean) / std if scale_rewards else r - mean for r in rewards]


def role_advantages(
    trajectories: Sequence[Trajectory], scale_rewards: bool = True, group_index: int = 0
) -> dict[str, list[float]]:
    """Per-role group advantages: for each role named in a trajectory's `rewards_by_role`, the advantages of the
    group's rewards for that role (a trajectory's overall reward where it gives none), plus its calls' rewards. A role whose rewards are
    all equal gets zeros: its tokens carry no signal, whatever the overall rewards say."""
    roles = sorted({role for t in trajectories for role in t.rewards_by_role})
    out: dict[str, list[float]] = {}
    for role in roles:
        rewards = [total_reward(t, float(t.rewards_by_role.get(role, t.reward))) for t in trajectories]
        advantages = group_advantages(rewards, scale_rewards=scale_rewards, group_index=group_index)
        out[role] = advantages if advantages is not None else [0.0] * len(rewards)
    return out


@dataclass
class StepTotals:
    """Totals over the whole step, so each micro-batch's loss is its exact share of the step's loss."""

    trained_tokens: int
    trajectories: int


def policy_loss(
    new_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sequence_index: torch.Tensor,
    config: TrainConfig,
    totals: StepTotals,
    ref_logprobs: torch.Tensor | None = None,
    staleness: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch's trained tokens (1-D tensors, one entry per trained token).

    `sequence_index[t]` numbers the token's trajectory inside the micro-batch (0..n-1; a trajectory is never split
    across micro-batches). NaN sampled logprobs (none returned, or excluded) get behaviour weight 1.
    `staleness[t]`: steps between the trainer and the policy that sampled the token (metrics only).
    `proximal_logprobs`: the policy the ratio is clipped against (default: this forward pass, detached).
    Returns the loss to backpropagate and sums for the step's metrics (divide by `tokens`).
    """
    # 1. The behaviour weight: how much likelier the pre-step policy finds the token than its sampler, truncated.
    proximal = new_logprobs.detach() if proximal_logprobs is None else proximal_logprobs
    sampled = torch.where(torch.isnan(sampled_logprobs), proximal, sampled_logprobs)
    cap = config.truncated_importance_sampling
    behaviour = torch.exp(proximal - sampled)
    weight = torch.clamp(behaviour, max=cap)
    if config.behaviour_weight == "sign_aware":
        weight = torch.where(advantages > 0, torch.clamp(behaviour, min=1.0, max=cap), weight)

    # 2. The proximal ratio, per token or (GSPO) the trajectory's geometric mean with per-token gradients.
    log_ratio = new_logprobs - proximal
    num_seqs = int(sequence_index.max().item()) + 1 if sequence_index.numel() else 0
    seq_tokens = torch.zeros(num_seqs, dtype=new_logprobs.dtype, device=new_logprobs.device)
    seq_tokens.index_add_(0, sequence_index, torch.ones_like(new_logprobs))
    tokens_of_seq = seq_tokens[sequence_index]
    if config.loss == "gspo":
        seq_log_ratio = torch.zeros_like(seq_tokens).index_add_(0, sequence_index, log_ratio.detach())
        seq_log_ratio = (seq_log_ratio / seq_tokens)[sequence_index]
        ratio = torch.exp(new_logprobs - new_logprobs.detach() + seq_log_ratio)
    else:
        ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.epsilon, 1.0 + config.clip_high
    clipped_ratio = torch.clamp(ratio, low, high)

    # 3. The policy-gradient term.
    if config.loss == "cispo":
        per_token = -clipped_ratio.detach() * advantages * new_logprobs * weight
        clipped = (ratio < low) | (ratio > high)
    else:
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages) * weight
        clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))

    # 4. Optional KL to the reference policy (k3: unbiased, always >= 0).
    kl = torch.zeros_like(new_logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
        if config.beta > 0:
            per_token = per_token + config.beta * kl

    # 5. Normalization by step totals (invariant to how the step is split into micro-batches).
    if config.normalization == "token":
        weights = torch.full_like(per_token, 1.0 / max(totals.trained_tokens, 1))
    else:
        weights = 1.0 / (tokens_of_seq * max(totals.trajectories, 1))
    loss = (per_token * weights).sum()

    sums = {
        "loss": float(loss.detach()),
        "tokens": float(new_logprobs.numel()),
        "staleness": float(staleness.sum()) if staleness is not None else 0.0,
        "stale": float((staleness > 0).sum()) if staleness is not None else 0.0,
        "clipped": float(clipped.sum()),
        "truncated": float((behaviour > cap).sum()),
        "behaviour_weight": float(weight.sum()),
        "ratio": float(ratio.detach().sum()),
        "kl": float(kl.detach().sum()),
        # a maximum, not a sum: the largest fall from the sampler's probability to the pre-step policy's
        "stale_drop_max": stale_drop(sampled_logprobs, proximal, staleness),
    }
    return loss, sums


def stale_drop(sampled: torch.Tensor, proximal: torch.Tensor, staleness: torch.Tensor | None) -> float:
    """max(p_behaviour - p_proximal) over stale tokens whose sampled logprob is known (0 when there are none): how
    far the policy had already moved away from a token since the version that sampled it."""
    if staleness is None:
        return 0.0
    known = (staleness > 0) & ~torch.isnan(sampled)
    if not bool(known.any()):
        return 0.0
    return max(float((sampled[known].exp() - proximal[known].detach().exp()).max()), 0.0)


def reinforce_loss(
    new_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sequence_index: torch.Tensor,
    normalization: str,
    totals: StepTotals,
) -> torch.Tensor:
    """Plain REINFORCE, -A * logp normalised like `policy_loss`: its gradient is policy_loss's at weight 1."""
    if normalization == "token":
        return -(advantages * new_logprobs).sum() / max(totals.trained_tokens, 1)
    counts = torch.bincount(sequence_index).to(new_logprobs.dtype)[sequence_index]
    return -(advantages * new_logprobs / counts).sum() / max(totals.trajectories, 1)
