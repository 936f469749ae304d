"""A trajectory store as the source of `train_async` / `PipelineTrainer`: train continuously from what the agent
served, as rewards arrive. Rewarded trajectories are claimed, grouped by key, and handed to the pipeline as
already-finished groups (the "rollout" returns them); each step's trajectories are marked trained.

    source = StoreSource(store, key="group")
    await art.train_async(model, source.rollout, source, on_step=source.on_step)

The source keeps its own progress (the store's claims), so a resumed run skips none of its groups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ..store import TrajectoryStore
from ..trajectories import Trajectory, TrajectoryGroup
from .groups import GroupStats, Key, key_of, sampled_version


class StoreSource:
    """Groups of rewarded traffic from `store`, `min_size`..`max_size` trajectories of one `key` each.

    A key still short of `min_size` after `wait_s` is given up (its trajectories counted `skipped_alone`, marked
    done); trajectories without a key, or sampled more than `max_staleness` steps before the model's current step,
    are skipped and counted too. `groups()` ends after `idle_s` without a new reward (None: never; it then
    trains for as long as traffic comes)."""

    resumes_itself = True  # the pipeline's resume skips no scenario of ours: the store knows what was trained

    def __init__(
        self,
        store: TrajectoryStore,
        key: Key = "group",
        *,
        min_size: int = 2,
        max_size: int = 8,
        wait_s: float = 3600.0,
        poll_s: float = 1.0,
        idle_s: float | None = 60.0,
        max_staleness: int | None = None,
        claim: int = 256,
    ) -> None:
        self.store, self.key = store, key
        self.min_size, self.max_size = min_size, max_size
        self.wait_s, self.poll_s, self.idle_s = wait_s, poll_s, idle_s
        self.max_staleness, self.claim_size = max_staleness, claim
        self.stats = GroupStats()
        self.current_step: int | None = None
        self._waiting: dict[Any, tuple[float, list[tuple[str, Trajectory]]]] = {}

    async def rollout(self, model: Any, group: TrajectoryGroup) -> TrajectoryGroup:
        """The pipeline's rollout: the group was rolled out in production already."""
        if self.max_staleness is not None:
            self.current_step = await model.get_step()
        return group

    async def on_step(self, report: Any, batch: list[TrajectoryGroup]) -> None:
        """Mark the step's trajectories trained (they will not be claimed again)."""
        ids = [str(t.metadata["trajectory_id"]) for g in batch for t in g.trajectories]
        await asyncio.to_thread(self.store.mark_trained, ids)

    def __aiter__(self) -> AsyncIterator[TrajectoryGroup]:
        return self.groups()

    async def groups(self) -> AsyncIterator[TrajectoryGroup]:
        last_reward = time.monotonic()
        while True:
            claimed = await asyncio.to_thread(self.store.claim, self.claim_size)
            now = time.monotonic()
            if claimed:
                last_reward = now
            done: list[str] = []
            for trajectory_id, trajectory in claimed:
                self.stats.trajectories += 1
                value = key_of(trajectory, self.key)
                if value is None:
                    self.stats.skipped_unkeyed += 1
                    done.append(trajectory_id)
                elif self._stale(trajectory):
                    self.stats.skipped_stale += 1
                    done.append(trajectory_id)
                else:
                    self._waiting.setdefault(value, (now, []))[1].append((trajectory_id, trajectory))
            for value in list(self._waiting):
                since, members = self._waiting.pop(value)
                while len(members) >= self.min_size:
                    chunk, members = members[: self.max_size], members[self.max_size :]
                    self.stats.groups += 1
                    self.stats.grouped += len(chunk)
                    yield TrajectoryGroup([t for _, t in chunk], metadata={"key": str(value)[:200]})
                if members and now - since > self.wait_s:
                    self.stats.skipped_alone += len(members)
                    done += [i for i, _ in members]
                elif members:
                    self._waiting[value] = (since, members)
            if done:
                await asyncio.to_thread(self.store.mark_trained, done)
            if self.idle_s is not None and time.monotonic() - last_reward > self.idle_s:
                waiting = [i for _, members in self._waiting.values() for i, _ in members]
                await asyncio.to_thread(self.store.release, waiting)
                return
            if not claimed:
                await asyncio.sleep(self.poll_s)

    def _stale(self, trajectory: Trajectory) -> bool:
        if self.current_step is None or self.max_staleness is None:
            return False
        version = sampled_version(trajectory)
        return version is not None and self.current_step - version > self.max_staleness
