"""What the run does with rollouts' results: an evaluation's result as groups per split, whether a group carries any
learning signal, and scenarios (sync or async) as one async iterator."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any, TypeVar

from ..trajectories import Trajectory, TrajectoryGroup

S = TypeVar("S")


def eval_splits(result: Any) -> dict[str, list[TrajectoryGroup]]:
    """An evaluation's result as groups per split: `{split: items}` keeps each split's name, a list is `val`."""
    if result is None:
        return {}
    if isinstance(result, Mapping):
        return {str(split): as_groups(items) for split, items in result.items() if items}
    groups = as_groups(result)
    return {"val": groups} if groups else {}


def as_groups(items: Any) -> list[TrajectoryGroup]:
    if isinstance(items, TrajectoryGroup | Trajectory):
        items = [items]
    items = list(items or [])
    groups = [i for i in items if isinstance(i, TrajectoryGroup)]
    loose = [i for i in items if isinstance(i, Trajectory)]
    return groups + ([TrajectoryGroup(loose)] if loose else [])


def no_signal(group: TrajectoryGroup) -> bool:
    """All rewards equal (overall and per role): the group's advantages are all zero."""
    rewards = [t.reward for t in group.trajectories]
    if len(set(rewards)) > 1:
        return False
    roles = {role for t in group.trajectories for role in t.rewards_by_role}
    return all(len({t.rewards_by_role.get(r, t.reward) for t in group.trajectories}) <= 1 for r in roles)


SOURCE_DRY = object()  # the scenarios ran dry


async def _iterate(items: Iterable[S]) -> AsyncIterator[S]:
    for item in items:
        yield item


def as_async_iterator(items: Iterable[S] | AsyncIterable[S]) -> AsyncIterator[S]:
    if isinstance(items, AsyncIterable):
        return aiter(items)
    return _iterate(items)
