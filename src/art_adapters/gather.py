"""Run rollouts concurrently (ART's gather): tolerated failures, one progress bar, `after_each`, a concurrency bound."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from .trajectories import RolloutError, Trajectory, TrajectoryGroup, exception_record

AfterEach = Callable[[TrajectoryGroup], "TrajectoryGroup | list[TrajectoryGroup] | None | Awaitable[Any]"]


class _Gather:
    """Shared state of one gather: the failure budget, the progress bar and the concurrency bound."""

    def __init__(
        self,
        total: int,
        max_exceptions: int | float,
        pbar_desc: str | None,
        max_concurrent: int | None,
        max_metrics: int | None = 0,
        count_completion_tokens: bool = False,
    ):
        if max_exceptions < 0:
            raise ValueError(f"max_exceptions must be >= 0, not {max_exceptions}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, not {max_concurrent}")
        self.total = total
        self.max_exceptions = max_exceptions
        self.failures = 0
        self.rewards: list[float] = []
        self.max_metrics = max_metrics
        self.metric_sums: dict[str, float] = {}
        self.metric_counts: dict[str, int] = {}
        self.count_completion_tokens = count_completion_tokens
        self.completion_tokens = 0
        self.semaphore = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self.pbar: Any = None
        if pbar_desc is not None:
            from .progress import progress_bar

            self.pbar = progress_bar(total, pbar_desc, "rollout")

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
        """Advance the progress bar (its running means exist only to be shown, so nothing is kept without one)."""
        if self.pbar is None or self.pbar.disable:
            return
        if trajectory is not None:
            self.rewards.append(trajectory.reward)
            if self.count_completion_tokens:
                self.completion_tokens += completion_tokens(trajectory)
            if self.max_metrics != 0:
                for key, value in trajectory.metrics.items():
                    if isinstance(value, int | float):
                        self.metric_sums[key] = self.metric_sums.get(key, 0.0) + float(value)
                        self.metric_counts[key] = self.metric_counts.get(key, 0) + 1
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
        postfix: dict[str, Any] = {"reward": f"{mean:.3f}", "exceptions": self.failures}
        if self.count_completion_tokens:
            postfix["completion_tokens"] = self.completion_tokens
        keys = list(self.metric_sums)
        if self.max_metrics is not None:  # None: every metric; N: the first N seen
            keys = keys[: self.max_metrics]
        for key in keys:
            postfix[key] = f"{self.metric_sums[key] / self.metric_counts[key]:.3g}"
        self.pbar.set_postfix(postfix, refresh=False)
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

    async def rollout(
        self, awaitable: Awaitable[Any], *, many: bool = False
    ) -> Trajectory | list[Trajectory] | BaseException:
        """One rollout's result, or its exception (returned, once counted, while within the budget).

        `many`: the awaitable may also give an iterable of Trajectories (ART's `gather_trajectories`)."""
        async with self.slot():
            try:
                result = await awaitable
            except Exception as error:
                self.failed(error)
                return error
        if isinstance(result, Trajectory):
            self.done(result)
            return result
        if many and isinstance(result, Iterable) and not isinstance(result, str | bytes | dict):
            items = list(result)
            if all(isinstance(t, Trajectory) for t in items):
                for t in items:
                    self.done(t)
                return items
        error = RolloutError(f"rollout returned {type(result).__name__}, not a Trajectory")
        self.failed(error)
        return error

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
                item.exceptions.append(exception_record(result))  # type: ignore[arg-type]
        return item

    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()


def completion_tokens(trajectory: Trajectory) -> int:
    """Tokens the model generated in a rollout: its captured calls' (sampled ids, else the usage the server
    reported), or, for a hand-built trajectory, its Choices' sampled ids."""
    if trajectory.llm_calls:
        total = 0
        for call in trajectory.llm_calls:
            if call.completion_token_ids is not None:
                total += len(call.completion_token_ids) + sum(
                    len(c.token_ids or []) for c in call.other_choices
                )
            else:
                usage = (call.response or {}).get("usage") or {}
                total += int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        return total
    total = 0
    for history in [trajectory, *trajectory.additional_histories]:
        for item in history.messages_and_choices:
            extra = getattr(item, "model_extra", None) or {}  # a Choice: its sampled ids ride as an extra
            total += len(extra.get("token_ids") or [])
    return total


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
    max_metrics: int | None = 0,
    pbar_total_completion_tokens: bool = False,
) -> list[TrajectoryGroup]:
    """Run every group's rollouts concurrently and return the groups in input order.

    `max_exceptions`: how many rollouts may fail, a count or a fraction in (0, 1) of all rollouts; tolerated
    failures land in `group.exceptions`, one more re-raises that rollout's exception (the rest are cancelled).
    `after_each(group)` (sync or async) runs as each group finishes and returns the group to keep, a replacement
    (or a list of groups), or None to drop it. `max_concurrent` bounds the rollouts running at once.
    `pbar_desc=None` hides the progress bar (running reward mean and exception count, plus the means of the
    first `max_metrics` trajectory metrics; None shows all of them; `pbar_total_completion_tokens` adds the
    tokens generated so far).
    """
    items = list(groups)
    total = sum(len(g.pending) for g in items if isinstance(g, TrajectoryGroup))
    context = _Gather(
        total, max_exceptions, pbar_desc, max_concurrent, max_metrics, pbar_total_completion_tokens
    )

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
    trajectories: Iterable[Awaitable[Trajectory] | Awaitable[Iterable[Trajectory]]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_concurrent: int | None = None,
    pbar_total_completion_tokens: bool = False,
) -> list[Any]:
    """Run rollouts concurrently; their results in input order (ART's contract): a Trajectory, or a list of them
    where a rollout returns several, and, within `max_exceptions` (as in `gather_trajectory_groups`), the
    exception of each failed rollout in its place."""
    pending = list(trajectories)
    context = _Gather(
        len(pending), max_exceptions, pbar_desc, max_concurrent, 0, pbar_total_completion_tokens
    )
    try:
        return await _all(context.rollout(p, many=True) for p in pending)
    finally:
        context.close()


async def trajectory_group_batches(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = False,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield batches of `batch_size` finished groups as soon as they are done (the last may be smaller), keeping
    `batch_size * max_concurrent_batches` groups in flight; `skip_batches` skips the first groups (resuming).
    A group whose rollouts fail beyond `max_batch_exceptions` raises; a group that fails as a whole is dropped
    while within it."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    items = list(groups)
    skipped, waiting = items[: batch_size * skip_batches], items[batch_size * skip_batches :]
    for item in skipped:  # never run: close their coroutines instead of leaving them un-awaited
        for awaitable in item.pending if isinstance(item, TrajectoryGroup) else [item]:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()
    total = sum(len(g.pending) for g in waiting if isinstance(g, TrajectoryGroup))
    context = _Gather(total, max_batch_exceptions, pbar_desc, None, 0, pbar_total_completion_tokens)

    async def one(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup | None:
        if not isinstance(item, TrajectoryGroup):
            try:
                item = await item
            except Exception as error:
                context.failed(error)  # re-raises beyond the budget
                return None
        return await context.group(item)

    running: set[asyncio.Task[TrajectoryGroup | None]] = set()
    batch: list[TrajectoryGroup] = []
    try:
        while waiting or running:
            while waiting and len(running) < batch_size * max_concurrent_batches:
                running.add(asyncio.ensure_future(one(waiting.pop(0))))
            finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                group = task.result()
                if group is not None:
                    batch.append(group)
            while len(batch) >= batch_size:
                yield batch[:batch_size]
                batch = batch[batch_size:]
        if batch:
            yield batch
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        context.close()
