"""A GRPO step's input made ready: group advantages attached, trajectories tokenized, the step's certificate
metrics counted, and the reasons a step trains nothing put in words (`skip_reason`); SFT's batches."""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..config import SFTConfig, TrainConfig
from ..sources import CallSource
from ..trajectories import Trajectory, TrajectoryGroup, reward_missing
from .loss import group_advantages, role_advantages
from .tokenize import TRAIN_ON_KEYS, TokenizationError, TrainSequence, tokenize_trajectory
from .turn_credit import group_credit, total_reward

log = logging.getLogger(
    "art_adapters.training.trainer"
)  # where users (and tests) look for the step's warnings
Metrics = dict[str, Any]


def prepare_groups(
    tokenizer: Any,
    vocab_size: int,
    groups: list[TrajectoryGroup],
    config: TrainConfig,
    *,
    max_seq_len: int,
    select: Callable[[CallSource | None], bool] | None = None,
) -> tuple[list[TrainSequence], Metrics]:
    """Attach each trajectory's group advantage, computed over the whole group (a trajectory that trains no
    token, say one that never reached a `train_on` node, still counts in its group's baseline), then tokenize
    every trajectory (groups never mix). A trajectory whose reward is missing (flagged `reward_missing`: an
    imported trace nothing rewarded) is left out before anything is computed, counted `skipped_reward_missing`
    (and in `skipped_trajectories`): never trained as the 0.0 it holds. A trajectory longer than `max_seq_len`
    (the step's limit) is skipped whole and counted (`skipped_too_long`), with one warning for the step naming
    each and its length."""
    groups, missing = _without_missing_rewards(groups)
    rewards = [t.reward for g in groups for t in g.trajectories]
    metrics: Metrics = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "reward_std": _std(rewards),
        "groups": len(groups),
        "trajectories": len(rewards),
        "skipped_groups": 0,
        "groups_without_samples": 0,
        "skipped_trajectories": missing,
        "skipped_reward_missing": missing,
        "skipped_too_long": 0,
        "trained_tokens": 0,
        "ratio_excluded_tokens": 0,
        "ratio_missing_tokens": 0,
        "left_out_tokens": 0,
    }
    excluded_reasons: set[str] = set()
    too_long: list[str] = []
    skipped: dict[str, int] = {}  # skipped trajectories by why (TokenizedTrajectory.skip_kind)
    sequences: list[TrainSequence] = []
    fractions: list[float] = []
    captured: list[float] = []
    unmatched = _Unmatched(config.train_on)
    for g, group in enumerate(groups):
        trajectories = group.trajectories
        advantages = group_advantages(
            [total_reward(t) for t in trajectories], scale_rewards=config.scale_rewards, group_index=g
        )
        by_role = role_advantages(trajectories, config.scale_rewards, g)
        credit = group_credit(trajectories, config, g)  # per-call advantages; None under "trajectory"
        tokenized: list[tuple[int, list[TrainSequence]]] = []
        group_too_long = 0
        for i, trajectory in enumerate(trajectories):
            if credit is not None and credit.no_calls[i]:  # turn-level credit needs calls: none, no advantage
                metrics["skipped_trajectories"] += 1
                skipped["no_calls"] = skipped.get("no_calls", 0) + 1
                continue
            out = tokenize_trajectory(
                trajectory,
                tokenizer,
                max_seq_len=max_seq_len,
                vocab_size=vocab_size,
                group_index=g,
                trajectory_index=i,
                train_unkept_choices=config.train_unkept_choices,
                train_on=dict(config.train_on) if config.train_on else None,
                train_retokenized_text=config.train_retokenized_text,
                select=select,  # per-agent adapters: this adapter's calls (training/per_agent.py)
            )
            unmatched.saw(trajectory, out.sources)
            if out.too_long:
                too_long.append(f"trajectory {i} of group {g} ({out.too_long} tokens)")
                group_too_long += 1
            metrics["ratio_excluded_tokens"] += out.excluded_tokens
            metrics["ratio_missing_tokens"] += out.missing_tokens
            metrics["left_out_tokens"] += out.left_out_tokens
            excluded_reasons |= out.excluded_reasons
            if out.skipped:
                metrics["skipped_trajectories"] += 1
                skipped[out.skip_kind] = skipped.get(out.skip_kind, 0) + 1
            else:
                trajectory.metrics["sampled_token_fraction"] = out.sampled_token_fraction
                trajectory.metrics["captured_token_fraction"] = out.captured_token_fraction
                tokenized.append((i, out.sequences))
        if not tokenized:
            if group_too_long < len(trajectories):  # not only over-long ones: some had nothing sampled
                metrics["groups_without_samples"] += 1
            continue
        if credit is None and advantages is None and not any(any(values) for values in by_role.values()):
            metrics["skipped_groups"] += 1
            continue
        for i, seqs in tokenized:
            for sequence in seqs:
                sequence.advantage = advantages[i] if advantages is not None else 0.0
                sequence.role_advantages = {role: values[i] for role, values in by_role.items()}
                sequence.call_advantages = credit.of(i) if credit is not None else {}
        if credit is not None and not _any_trained_advantage(s for _, seqs in tokenized for s in seqs):
            metrics["skipped_groups"] += 1  # the calls this step trains (train_on, an agent's) carry none
            continue
        for i, seqs in tokenized:
            fractions.append(trajectories[i].metrics["sampled_token_fraction"])
            captured.append(trajectories[i].metrics["captured_token_fraction"])
            sequences.extend(seqs)
    # Over the trajectories the step trains: a step that trains nothing certifies nothing (0.0, not 1.0).
    metrics["sampled_token_fraction"] = min(fractions, default=0.0)
    metrics["captured_token_fraction"] = min(captured, default=0.0)
    metrics.update({f"skipped_{kind}": n for kind, n in skipped.items() if kind})
    if fractions and metrics["sampled_token_fraction"] < 1.0 and not config.train_retokenized_text:
        raise TokenizationError(
            f"sampled_token_fraction is {metrics['sampled_token_fraction']:.4f}: some trained tokens were not "
            "sampled by the engine; refusing to train on them (TrainConfig(train_retokenized_text=True) "
            "allows re-tokenized text)"
        )
    metrics["trained_tokens"] = sum(s.num_trained for s in sequences)
    if metrics["ratio_excluded_tokens"]:
        log.warning(
            "%d sampled tokens came from distributions the trainer does not reproduce (%s): trained without an "
            "importance ratio (on-policy weight 1), see training/loss.py",
            metrics["ratio_excluded_tokens"],
            "; ".join(sorted(excluded_reasons)),
        )
    if metrics["ratio_missing_tokens"]:
        log.warning(
            "%d trained tokens have no sampled logprob (the engine returned none for them, e.g. Responses API "
            "tool calls): trained without an importance ratio (on-policy weight 1)",
            metrics["ratio_missing_tokens"],
        )
    unmatched.warn()
    # One warning for the step's skipped trajectories (a step that trains nothing says why in `skip_reason`, but
    # still names its over-long ones here); a trajectory `train_on` leaves out is the user's choice: counted only.
    if (sequences and (set(skipped) - {"not_in_train_on"} or missing)) or too_long:
        log.warning(
            "%d of %d trajectories trained nothing this step: %s%s",
            metrics["skipped_trajectories"],
            metrics["trajectories"] + missing,
            _skipped_words(metrics),
            f" (max_seq_len={max_seq_len}: {', '.join(too_long)})" if too_long else "",
        )
    return sequences, metrics


def _any_trained_advantage(sequences: Iterable[TrainSequence]) -> bool:
    """Whether a token these sequences train has a non-zero advantage (turn-level credit gives each call its own:
    a group whose trained calls all have 0 teaches nothing, whatever the calls left as context have)."""
    return any(
        s.advantage_at(p) != 0.0 for s in sequences for p, trained in enumerate(s.trained_mask) if trained
    )


def _without_missing_rewards(groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], int]:
    """The groups without their trajectories flagged `reward_missing` (the same groups when none is), and how
    many were left out; a group is kept even when emptied, so group indices stay those the caller gave."""
    missing = sum(reward_missing(t) for g in groups for t in g.trajectories)
    if not missing:
        return groups, 0
    kept = []
    for group in groups:
        copied = copy.copy(group)  # its own list: the caller's group keeps every trajectory
        copied.trajectories = [t for t in group.trajectories if not reward_missing(t)]
        kept.append(copied)
    return kept, missing


def sft_batches(trajectories: list[Trajectory], config: SFTConfig) -> Iterator[list[Trajectory]]:
    """The SFT run as batches: `epochs` seeded shuffles, `batch_size` trajectories each."""
    rng = random.Random(config.seed)
    for _ in range(config.epochs):
        order = list(range(len(trajectories)))
        rng.shuffle(order)
        for i in range(0, len(order), int(config.batch_size)):
            yield [trajectories[j] for j in order[i : i + int(config.batch_size)]]


def skip_reason(groups: list[TrajectoryGroup], metrics: Metrics) -> str:
    """Why a step has nothing to train, in words a user can act on."""
    parts = []
    if metrics["skipped_groups"]:
        parts.append(
            f"{metrics['skipped_groups']} group(s) have equal rewards for all their trajectories (no advantage)"
        )
    if metrics["groups_without_samples"]:
        plain = any(
            isinstance(item, dict) and item.get("role") == "assistant"
            for g in groups
            for t in g.trajectories
            for item in t.messages_and_choices
        )
        hint = (
            "their assistant turns are plain message dicts, which carry no sampled tokens: append the Choice "
            "(`completion.choices[0]`) from `model.openai_client()`, or run the agent inside `wrap_rollout` / "
            "`art.trajectory(...)` so its calls are captured"
            if plain
            else "capture the calls through `model.openai_client()`, `wrap_rollout` or `art.trajectory(...)`"
        )
        parts.append(f"{metrics['groups_without_samples']} group(s) have no sampled token ids: {hint}")
    if metrics.get("skipped_reward_missing"):
        parts.append(f"{metrics['skipped_reward_missing']} trajectories have no reward (reward missing)")
    if metrics.get("skipped_too_long"):
        parts.append(
            f"{metrics['skipped_too_long']} trajectory(ies) are longer than max_seq_len (skipped, not truncated)"
        )
    if not groups or not metrics["trajectories"]:
        parts.append("no trajectories were given")
    return "no trainable tokens: " + ("; ".join(parts) or "no trajectory trains a token")


_SKIPPED_WHY = {
    "no_sampled_ids": "have no sampled token ids (plain assistant messages, or calls not captured through "
    "`model.openai_client()` / `wrap_rollout` / `art.trajectory(...)`; TrainConfig(train_retokenized_text=True) "
    "trains re-rendered text)",
    "too_long": "are longer than max_seq_len (skipped whole, never truncated)",
    "reward_missing": "have no reward (reward missing: map it with the importer's missing_reward=, or give each a reward)",
    "no_trainable_token": "have no trainable token (only a first token was sampled)",
    "not_in_train_on": "have no call among train_on",
    "no_calls": "have no captured call, so turn-level credit (TrainConfig.advantage 'turn' / 'gigpo') gives them "
    "no advantage (capture the calls through `model.openai_client()`, `wrap_rollout` or `art.trajectory(...)`)",
}


def _skipped_words(metrics: Metrics) -> str:
    """The step's skipped trajectories by why, in one line ("3 have no sampled token ids (...); 1 ...")."""
    counts = {kind: metrics.get(f"skipped_{kind}", 0) for kind in _SKIPPED_WHY}
    return "; ".join(f"{n} trajectory(ies) {_SKIPPED_WHY[kind]}" for kind, n in counts.items() if n)


class _Unmatched:
    """Names in `train_on` and keys of `rewards_by_role` that match no call (a typo trains nothing, silently)."""

    def __init__(self, train_on: dict[str, list[str]] | None) -> None:
        self.train_on = {key: set(names) for key, names in (train_on or {}).items()}
        self.role_keys: set[str] = set()
        self.matched_roles: set[str] = set()

    def saw(self, trajectory: Trajectory, sources: list[CallSource]) -> None:
        for key, names in self.train_on.items():
            by = TRAIN_ON_KEYS[key]
            names -= {name for name in names if any(s.matches(by, {name}) for s in sources)}
        for role in trajectory.rewards_by_role:
            self.role_keys.add(role)
            if any(s.matches("role", {role}) for s in sources):
                self.matched_roles.add(role)

    def warn(self) -> None:
        parts = [f"train_on[{key!r}] {sorted(names)}" for key, names in self.train_on.items() if names]
        roles = sorted(self.role_keys - self.matched_roles)
        if roles:
            parts.append(f"rewards_by_role keys {roles}")
        if parts:
            log.warning(
                "%s match no captured call in this step (a call matches by its role, agent, node name or node "
                "path; see CallSource.role_names)",
                " and ".join(parts),
            )


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
