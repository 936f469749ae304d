"""Choosing and grouping production trajectories: the best ones for SFT, and groups by a key for off-policy RL
(too-old, unkeyed and lone ones skipped and counted)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from ..trajectories import Trajectory, TrajectoryGroup, reward_missing

Key = str | Callable[[Trajectory], Any]


class GroupStats(BaseModel):
    """What grouping kept and why it left the rest out."""

    trajectories: int = 0
    groups: int = 0
    grouped: int = 0
    skipped_unkeyed: int = 0  # no key: nothing to compare them with
    skipped_stale: int = 0  # sampled by a policy more than `max_staleness` steps behind
    skipped_alone: int = 0  # the only one (or too few) of their key
    skipped_no_reward: int = 0  # no reward came (flagged `reward_missing`), or one that is not finite
    skipped_unreadable: int = 0  # stored, but could not be read back (the store logs and names each)


def has_reward(trajectory: Trajectory) -> bool:
    """A finite reward that came with the trajectory (not the placeholder of one flagged `reward_missing`)."""
    return math.isfinite(trajectory.reward) and not reward_missing(trajectory)


def key_of(trajectory: Trajectory, key: Key) -> Any:
    """`key` names a metadata field ("task"), "prompt" (the first user message's text), or is a function."""
    if callable(key):
        return key(trajectory)
    if key == "prompt":
        user = next((m for m in trajectory.messages() if m.get("role") == "user"), None)
        return None if user is None else str(user.get("content"))
    return trajectory.metadata.get(key)


def sampled_version(trajectory: Trajectory) -> int | None:
    """The oldest policy version that sampled the trajectory (its calls' versions, else its own record)."""
    versions = [c.policy_version for c in trajectory.llm_calls if c.policy_version is not None]
    if versions:
        return min(versions)
    return trajectory.initial_policy_version


def groups_by_key(
    trajectories: Iterable[Trajectory],
    key: Key = "prompt",
    *,
    min_size: int = 2,
    max_size: int | None = None,
    current_step: int | None = None,
    max_staleness: int | None = None,
) -> tuple[list[TrajectoryGroup], GroupStats]:
    """Trajectories of the same key (the same task, the same prompt) as groups for GRPO; each trains against the
    recorded logprobs of the policy that sampled it, its staleness the trainer's step minus the recorded version
    (training/loss.py's async correction). Left out, and counted: no key, no reward (flagged `reward_missing`, or
    not finite), sampled more than
    `max_staleness` steps before `current_step`, or fewer than `min_size` of a key. A key with more than
    `max_size` makes several groups."""
    stats = GroupStats()
    buckets: dict[Any, list[Trajectory]] = {}
    for trajectory in trajectories:
        stats.trajectories += 1
        if not has_reward(trajectory):
            stats.skipped_no_reward += 1
            continue
        if current_step is not None and max_staleness is not None:
            version = sampled_version(trajectory)
            if version is not None and current_step - version > max_staleness:
                stats.skipped_stale += 1
                continue
        value = key_of(trajectory, key)
        if value is None:
            stats.skipped_unkeyed += 1
            continue
        buckets.setdefault(value, []).append(trajectory)
    groups: list[TrajectoryGroup] = []
    for value, members in buckets.items():
        size = max_size or len(members)
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            if len(chunk) < min_size:
                stats.skipped_alone += len(chunk)
                continue
            groups.append(TrajectoryGroup(chunk, metadata={"key": str(value)[:200]}))
            stats.grouped += len(chunk)
    stats.groups = len(groups)
    return groups, stats


def best_traces(
    trajectories: Iterable[Trajectory],
    *,
    top_fraction: float | None = 0.25,
    min_reward: float | None = None,
    key: Key | None = None,
) -> list[Trajectory]:
    """The best trajectories for SFT: those with at least `min_reward`, and of those the top `top_fraction` by
    reward (within each `key`'s trajectories when a key is given, so every task keeps its best). A trajectory
    without a reward (flagged `reward_missing`, or not finite) is never among them."""
    pool = [t for t in trajectories if has_reward(t)]
    if min_reward is not None:
        pool = [t for t in pool if t.reward >= min_reward]
    if top_fraction is None:
        return pool
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction is in (0, 1], not {top_fraction}")
    buckets: dict[Any, list[Trajectory]] = {}
    for trajectory in pool:
        buckets.setdefault(key_of(trajectory, key) if key is not None else None, []).append(trajectory)
    out: list[Trajectory] = []
    for members in buckets.values():
        members.sort(key=lambda t: t.reward, reverse=True)
        out += members[: max(1, math.ceil(len(members) * top_fraction))]
    return out
