"""ART's scope API (`with art.Trajectory()`, `art.trajectory(...)`, `current_trajectory()`, `yield_trajectory`,
`await art.TrajectoryGroup(...)`) as names for the one capture mechanism: the adapters' scope (recording transport
+ contextvar) with no model, so every chat completion made inside, by any httpx-based client, is recorded. The
data contract names this behaviour (`trajectories.RolloutScopes`); `SCOPES` is what `art_adapters` gives it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from contextvars import ContextVar
from typing import Any

from ..capture.scope import current_trajectory
from ..gather import gather_trajectory_groups
from ..trajectories import Trajectory, TrajectoryGroup, exception_record
from .base import scope

_GROUPS: ContextVar[tuple[TrajectoryGroup, ...]] = ContextVar("art_adapters_groups", default=())


def enter_trajectory(trajectory: Trajectory) -> Trajectory:
    if trajectory._scope is not None:
        raise RuntimeError("this Trajectory's scope is already open")
    manager = scope(None, trajectory=trajectory, main="first")
    manager.__enter__()
    trajectory._scope = manager
    return trajectory


def exit_trajectory(trajectory: Trajectory, *exc_info: Any) -> None:
    manager, trajectory._scope = trajectory._scope, None
    if manager is None:
        raise RuntimeError("this Trajectory's scope is not open")
    manager.__exit__(*(exc_info or (None, None, None)))
    groups = _GROUPS.get()
    if groups and all(t is not trajectory for t in groups[-1].trajectories):
        groups[-1].trajectories.append(trajectory)


def enter_group(group: TrajectoryGroup) -> TrajectoryGroup:
    _GROUPS.set((*_GROUPS.get(), group))
    return group


def exit_group(group: TrajectoryGroup) -> None:
    groups = _GROUPS.get()
    if not groups or groups[-1] is not group:
        raise RuntimeError("TrajectoryGroup scopes must close in the order they opened")
    _GROUPS.set(groups[:-1])


def current_trajectory_group(*, required: bool = False) -> TrajectoryGroup | None:
    groups = _GROUPS.get()
    if groups:
        return groups[-1]
    if required:
        raise RuntimeError("no `with art.TrajectoryGroup():` scope is open here")
    return None


def _raw_coroutine(value: Any) -> Coroutine[Any, Any, Any]:
    if not isinstance(value, Coroutine):
        raise TypeError(
            f"expected a coroutine (call the async function, don't await it), not {type(value).__name__}"
        )
    return value


async def trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run the coroutine inside a new trajectory scope and return the Trajectory of every call it made."""
    with Trajectory() as captured:
        await _raw_coroutine(coroutine)
    return captured


async def trajectory_group(
    trajectories: Iterable[Coroutine[Any, Any, Trajectory]], *, return_exceptions: bool = False
) -> TrajectoryGroup:
    """Run the coroutines (each returning a Trajectory) concurrently into one group; with `return_exceptions`,
    failures land in `group.exceptions` instead of raising."""
    coroutines = [_raw_coroutine(c) for c in trajectories]
    results = await asyncio.gather(*coroutines, return_exceptions=return_exceptions)
    done = [r for r in results if isinstance(r, Trajectory)]
    errors = [exception_record(r) for r in results if isinstance(r, BaseException)]
    wrong = [type(r).__name__ for r in results if not isinstance(r, Trajectory | BaseException)]
    if wrong:
        raise TypeError(f"trajectory_group: coroutines must return Trajectory objects, got {wrong}")
    return TrajectoryGroup(done, exceptions=errors)


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """ART 0.4's name for `current_trajectory`."""
    return current_trajectory(required=required)


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """ART 0.4's name for `trajectory`."""
    return await trajectory(coroutine)


class _Yielded:
    __slots__ = ("trajectory",)

    def __init__(self) -> None:
        self.trajectory: Trajectory | None = None


_YIELDED: ContextVar[_Yielded | None] = ContextVar("art_adapters_yielded", default=None)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (a no-op outside one)."""
    holder = _YIELDED.get()
    if holder is not None:
        holder.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run the coroutine and return the Trajectory it passed to `yield_trajectory` (RuntimeError if none)."""
    holder = _Yielded()
    token = _YIELDED.set(holder)
    try:
        await _raw_coroutine(coroutine)
    finally:
        _YIELDED.reset(token)
    if holder.trajectory is None:
        raise RuntimeError("the coroutine finished without calling yield_trajectory(...)")
    return holder.trajectory


async def gather_group(group: TrajectoryGroup) -> TrajectoryGroup:
    """`await group`: run its pending rollouts (any failure raises; `gather_trajectory_groups` tolerates some)."""
    return (await gather_trajectory_groups([group], pbar_desc=None))[0]


class _Scopes:
    """The rollout scopes `Trajectory` and `TrajectoryGroup` open and await (see the module docstring)."""

    enter_trajectory = staticmethod(enter_trajectory)
    exit_trajectory = staticmethod(exit_trajectory)
    enter_group = staticmethod(enter_group)
    exit_group = staticmethod(exit_group)
    gather = staticmethod(gather_group)
    names = {
        "auto_trajectory": auto_trajectory,
        "capture_auto_trajectory": capture_auto_trajectory,
        "current_trajectory": current_trajectory,
        "current_trajectory_group": current_trajectory_group,
        "trajectory": trajectory,
        "trajectory_group": trajectory_group,
    }


SCOPES = _Scopes()
