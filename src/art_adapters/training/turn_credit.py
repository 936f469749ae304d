"""Credit per turn: per-call advantages from per-call rewards (`TrainConfig.advantage` "turn" and "gigpo"); the
default "trajectory" stays GRPO's one advantage per trajectory (`loss.group_advantages`).

A turn is one entry of `trajectory.llm_calls`. Its reward r_t is `call.reward` (0 where none); the trajectory's
reward R is added at its final call, so the rewards a trajectory of T calls earns are r_0, ..., r_{T-2},
r_{T-1} + R, and its return-to-go from turn t is G_t = sum_{k >= t} gamma^(k-t) r'_k.

  "turn":  A_{i,t} = (G_{i,t} - b_t) / s_t.   b_t = mean over the group's trajectories j of G_{j, min(t, T_j - 1)}
           (a trajectory that already stopped keeps its last return-to-go); s_t = the std of those same values
           (GRPO's std when rewards come only at the end; 0 advantage at a turn where they are all equal, so
           |A| <= sqrt(n - 1) as in GRPO); no s_t without `scale_rewards`. b_t holds one term per trajectory, whatever
           the trajectory's own length, so it is no function of whether this trajectory stops or goes on: the
           estimator has no length bias (unlike normalising per turn index and summing, verl RFC #7244; see
           docs/training.md). gamma=1 with rewards only at the end gives GRPO's advantages exactly.
  "gigpo": A = A_episode + gigpo_weight * A_step (GiGPO, arXiv 2505.10978): A_episode is GRPO's on each
           trajectory's total reward R + sum_t r_t; A_step compares a call with the group's calls from the same
           state (identical prompt token ids, or `state_key(call)`): (G_t - mean) / std over those calls, 0 for a
           state seen once.

Per-role rewards (`rewards_by_role`): a call whose role has one takes R from it (the same computation, run once
per role); `train_on` only chooses which calls train, every call still counts in the baselines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from ..calls import LLMCall
from ..config import TrainConfig
from ..trajectories import Trajectory
from .loss import RewardError, group_advantages, total_reward

StateKey = Callable[[LLMCall], Hashable | None]


def call_rewards(trajectory: Trajectory) -> list[float]:
    """Each call's reward (0.0 where none was given), in call order."""
    return [call.reward if call.reward is not None else 0.0 for call in trajectory.llm_calls]


def returns_to_go(rewards: Sequence[float], terminal: float, gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}, with `terminal` added to the last reward (G_{T-1} = r_{T-1} + terminal)."""
    out = [0.0] * len(rewards)
    last = len(rewards) - 1
    for t in range(last, -1, -1):
        out[t] = rewards[t] + terminal if t == last else rewards[t] + gamma * out[t + 1]
    return out


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def turn_advantages(
    returns: Sequence[Sequence[float]], *, scale_rewards: bool = True
) -> list[list[float]] | None:
    """The "turn" estimator over one group (see the module docstring): `returns[i][t]` is trajectory i's G_t
    (an empty list: a trajectory with no call, left out of every baseline). None when every advantage is 0."""
    present = [g for g in returns if g]
    if len(present) < 2:
        return None
    longest = max(len(g) for g in present)
    reached = [[g[min(t, len(g) - 1)] for g in present] for t in range(longest)]  # what b_t averages
    baselines = [sum(values) / len(values) for values in reached]
    centred = [[g[t] - baselines[t] for t in range(len(g))] for g in returns]
    if not scale_rewards:
        return centred if any(any(c) for c in centred) else None
    # each turn by its own spread: |A| <= sqrt(n - 1) as in GRPO (the first turn's std alone let a later turn's
    # advantage grow without bound when the first returns nearly agree); a turn with no spread gets 0
    scales = [_std(values) for values in reached]
    floors = [1e-8 * max(1.0, abs(b)) for b in baselines]
    scaled = [[c / scales[t] if scales[t] > floors[t] else 0.0 for t, c in enumerate(row)] for row in centred]
    return scaled if any(any(row) for row in scaled) else None


def step_advantages(
    returns: Sequence[Sequence[float]], states: Sequence[Sequence[Hashable | None]], *, scale_rewards: bool
) -> list[list[float]]:
    """GiGPO's step term: each call's G_t against the group's calls from the same state (0 where a state is seen
    once, has no spread, or is None)."""
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    for i, row in enumerate(states):
        for t, state in enumerate(row):
            if state is not None:
                groups.setdefault(state, []).append((i, t))
    out = [[0.0] * len(row) for row in returns]
    for members in groups.values():
        if len(members) < 2:
            continue
        values = [returns[i][t] for i, t in members]
        mean = sum(values) / len(values)
        std = _std(values)
        if std <= 1e-8 * max(1.0, abs(mean)):
            continue
        for (i, t), value in zip(members, values, strict=True):
            out[i][t] = (value - mean) / std if scale_rewards else value - mean
    return out


def prompt_ids_state(call: LLMCall) -> Hashable | None:
    """The default state of a call: its exact prompt token ids (None when none were captured)."""
    return tuple(call.prompt_token_ids) if call.prompt_token_ids else None


@dataclass
class GroupCredit:
    """Per-call advantages of one group: `calls[i][t]` for trajectory i's call t; `no_calls[i]`: trajectory i has
    no call, so it gets no advantage (skipped and counted, `skipped_no_calls`)."""

    calls: list[list[float]]
    no_calls: list[bool] = field(default_factory=list)

    def of(self, trajectory_index: int) -> dict[int, float]:
        return dict(enumerate(self.calls[trajectory_index]))


def _role_of(call: LLMCall, roles: set[str]) -> str | None:
    return next((name for name in call.source.role_names() if name in roles), None)


def group_credit(
    trajectories: Sequence[Trajectory], config: TrainConfig, group_index: int = 0
) -> GroupCredit | None:
    """The group's per-call advantages under `config.advantage`; None for "trajectory" (GRPO, loss.py)."""
    config.check_credit_settings()  # again: a setting assigned after construction was never validated
    if config.advantage == "trajectory":
        return None
    for i, trajectory in enumerate(
        trajectories
    ):  # refused as GRPO refuses them (call rewards are checked when set)
        for reward in [trajectory.reward, *trajectory.rewards_by_role.values()]:
            if not math.isfinite(reward):
                raise RewardError(
                    f"group {group_index}, trajectory {i}: reward is {reward}; rewards must be finite"
                )
    roles = sorted({role for t in trajectories for role in t.rewards_by_role})
    role_set = set(roles)
    rewards = [call_rewards(t) for t in trajectories]
    streams: dict[str | None, list[list[float]]] = {}
    for stream in [None, *roles]:
        terminals = [
            t.reward if stream is None else float(t.rewards_by_role.get(stream, t.reward))
            for t in trajectories
        ]
        returns = [
            returns_to_go(r, terminal, config.gamma) for r, terminal in zip(rewards, terminals, strict=True)
        ]
        if config.advantage == "turn":
            advantages = turn_advantages(returns, scale_rewards=config.scale_rewards)
            streams[stream] = advantages or [[0.0] * len(r) for r in returns]
        else:
            streams[stream] = _gigpo(trajectories, returns, terminals, config)
    calls = []
    for i, trajectory in enumerate(trajectories):
        row = []
        for t, call in enumerate(trajectory.llm_calls):
            role = _role_of(call, role_set) if roles else None
            row.append(streams[role][i][t])
        calls.append(row)
    return GroupCredit(calls=calls, no_calls=[not t.llm_calls for t in trajectories])


def _gigpo(
    trajectories: Sequence[Trajectory],
    returns: list[list[float]],
    terminals: list[float],
    config: TrainConfig,
) -> list[list[float]]:
    with_calls = [i for i, t in enumerate(trajectories) if t.llm_calls]
    totals = [total_reward(trajectories[i], terminals[i]) for i in with_calls]
    episode = group_advantages(totals, scale_rewards=config.scale_rewards) or [0.0] * len(totals)
    episode_of = dict(zip(with_calls, episode, strict=True))
    key: StateKey = config.state_key if callable(config.state_key) else prompt_ids_state
    states = [[_state(key, call) for call in t.llm_calls] for t in trajectories]
    steps = step_advantages(returns, states, scale_rewards=config.scale_rewards)
    weight = config.gigpo_weight
    return [[episode_of.get(i, 0.0) + weight * step for step in steps[i]] for i in range(len(trajectories))]


def _state(key: StateKey, call: LLMCall) -> Hashable | None:
    state = key(call)
    if state is not None:
        try:
            hash(state)
        except TypeError:
            raise TypeError(
                f"state_key returned an unhashable {type(state).__name__}: return a str, a tuple or None"
            ) from None
    return state
