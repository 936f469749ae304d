"""Run rollouts concurrently (ART's gather): tolerated failures, one progress bar, `after_each`, a concurrency bound."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from .trajectory import RolloutError, Trajectory, TrajectoryGroup, exception_record

AfterEach = Callable[[TrajectoryGroup], "TrajectoryGroup | list[TrajectoryGroup] | None | Awaitable[Any]"]


class _Gather:
    """Shared state of one gather: the failure budget, the progress bar and the concurrency bound."""

    def __init__(
        self, total: int, max_exceptions: int | float, pbar_desc: str | None, max_concurrent: int | None
    ):
        if max_exceptions < 0:
            raise ValueError(f"max_exceptions must be >= 0, not {max_exceptions}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, not {max_concurrent}")
        self.total = total
        self.max_exceptions = max_exceptions
        self.failures = 0
        self.rewards: list[float] = []
        self.semaphore = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self.pbar: Any = None
        if pbar_desc is not None:
            from tqdm.auto import tqdm

            self.pbar = tqdm(total=total, desc=pbar_desc, unit="rollout", dynamic_ncols=True)

    @property
    def allowed(self) -> float:
        if 0 < self.max_exceptions < 1:
            return self.max_exceptions * self.total
        return self.max_exceptions

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.semaphore is None:
            yield
        else:
            async with self.semaphore:
                yield

    def done(self, trajectory: Trajectory | None) -> None:
        if trajectory is not None:
            self.rewards.append(trajectory.reward)
        if self.pbar is not None:
            mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
            self.pbar.set_postfix(reward=f"{mean:.3f}", exceptions=self.failures, refresh=False)
            self.pbar.update(1)

    def failed(self, error: Exception) -> None:
        """Count a failure; re-raise it once more rollouts failed than allowed."""
        self.failures += 1
        self.done(None)
        if self.failures > self.allowed:
            error.add_note(
                f"{self.failures} of {self.total} rollouts failed, more than max_exceptions={self.max_exceptions}"
            )
            raise error

    async def rollout(self, awaitable: Awaitable[Trajectory]) -> Trajectory | dict[str, str]:
        async with self.slot():
            try:
                result = await awaitable
            except Exception as error:
                self.failed(error)
                return exception_record(error)
        if isinstance(result, Trajectory):
            self.done(result)
            return result
        error = RolloutError(f"rollout returned {type(result).__name__}, not a Trajectory")
        self.failed(error)
        return exception_record(error)

    async def group(self, item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup:
        if not isinstance(item, TrajectoryGroup):
            item = await item
            if not isinstance(item, TrajectoryGroup):
                raise TypeError(f"expected a TrajectoryGroup, got {type(item).__name__}")
            self.total += len(item.pending)  # its rollouts were not known up front
            if self.pbar is not None:
                self.pbar.total = self.total
        pending, item._pending = item._pending, []
        for result in await _all(self.rollout(p) for p in pending):
            if isinstance(result, Trajectory):
                item.trajectories.append(result)
            else:
                item.exceptions.append(result)
        return item

    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()


async def _all(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """asyncio.gather that cancels (and awaits) the rest as soon as one raises."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    max_concurrent: int | None = None,
    pbar_total_completion_tokens: bool = False,
) -> list[TrajectoryGroup]:
    """Run every group's rollouts concurrently and return the groups in input order.

    `max_exceptions`: how many rollouts may fail, a count or a fraction in (0, 1) of all rollouts; tolerated
    failures land in `group.exceptions`, one more re-raises that rollout's exception (the rest are cancelled).
    `after_each(group)` (sync or async) runs as each group finishes and returns the group to keep, a replacement
    (or a list of groups), or None to drop it. `max_concurrent` bounds the rollouts running at once.
    `pbar_desc=None` hides the progress bar (running reward mean and exception count).
    """
    items = list(groups)
    total = sum(len(g.pending) for g in items if isinstance(g, TrajectoryGroup))
    context = _Gather(total, max_exceptions, pbar_desc, max_concurrent)

    async def one(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        group = await context.group(item)
        if after_each is None:
            return [group]
        result = after_each(group)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        return list(result) if isinstance(result, list) else [result]

    try:
        results = await _all(one(item) for item in items)
    finally:
        context.close()
    return [group for result in results for group in result]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_concurrent: int | None = None,
) -> list[Trajectory]:
    """Run rollouts concurrently; the trajectories that succeeded, in input order (failures as in
    `gather_trajectory_groups`)."""
    pending = list(trajectories)
    context = _Gather(len(pending), max_exceptions, pbar_desc, max_concurrent)
    try:
        results = await _all(context.rollout(p) for p in pending)
    finally:
        context.close()
    return [r for r in results if isinstance(r, Trajectory)]
