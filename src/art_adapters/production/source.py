"""A trajectory store as the source of `train_async` / `PipelineTrainer`: train continuously from what the agent
served, as rewards arrive. Rewarded trajectories are claimed, grouped by key, and handed to the pipeline as
already-finished groups (the "rollout" returns them); each step's trajectories are marked trained.

    source = StoreSource(store, key="group", model=model)
    await art.train_async(model, source.rollout, source, on_step=source.on_step)

The source keeps its own progress (the store's claims), so a resumed run skips none of its groups.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from ..store import TrajectoryStore
from ..trajectories import Trajectory, TrajectoryGroup
from .groups import GroupStats, Key, has_reward, key_of, sampled_version

DEFAULT_LEASE_S = 600.0  # the store's own default: what another trainer's claim waits for
# ids yielded and not yet marked trained that a source remembers (never yielded twice)
MAX_HANDED_OUT = 100_000


class StoreSource:
    """Groups of rewarded traffic from `store`, `min_size`..`max_size` trajectories of one `key` each.

    A key still short of `min_size` after `wait_s` is given up (its trajectories counted `skipped_alone`, marked
    done); their claims last `lease_s` (default: `wait_s` + 10 minutes) and are renewed while they wait, so no
    trainer (this one included) claims them again, and a trajectory is never grouped with itself. Trajectories without a key or a
    reward (flagged `reward_missing`), or sampled more than `max_staleness`
    steps before the model's current step, are skipped and counted too; the step is asked of `model` before every
    claim and again before a waiting trajectory is yielded (without `model`, `current_step` must be set before
    iterating, and `rollout` keeps it current). `groups()` ends after `idle_s` without a new reward (None: never;
    it then trains for as long as traffic comes)."""

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
        model: Any = None,
        lease_s: float | None = None,
    ) -> None:
        for name, value in (("min_size", min_size), ("max_size", max_size), ("claim", claim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StoreSource: {name} is a whole number of trajectories >= 1, not {value!r}")
        if max_size < min_size:
            raise ValueError(f"StoreSource: max_size ({max_size}) is at least min_size ({min_size})")
        if not isinstance(wait_s, int | float) or not wait_s >= 0:
            raise ValueError(f"StoreSource: wait_s is a number of seconds >= 0, not {wait_s!r}")
        if lease_s is None:  # a claim outlasts the wait for partners (and is renewed while it waits)
            lease_s = wait_s + DEFAULT_LEASE_S if math.isfinite(wait_s) else DEFAULT_LEASE_S
        for name, number in (("poll_s", poll_s), ("lease_s", lease_s)):
            if (
                not isinstance(number, int | float)
                or not 0 <= number < math.inf
                or (name == "lease_s" and number == 0)
            ):
                raise ValueError(
                    f"StoreSource: {name} is a finite number of seconds (lease_s > 0), not {number!r}"
                )
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(
                f"StoreSource: max_staleness is a whole number of steps >= 0, not {max_staleness!r}"
            )
        self.store, self.key = store, key
        self.min_size, self.max_size = min_size, max_size
        self.wait_s, self.poll_s, self.idle_s = wait_s, poll_s, idle_s
        self.max_staleness, self.claim_size = max_staleness, claim
        self.model = model
        self.lease_s = lease_s
        self.stats = GroupStats()
        self.current_step: int | None = None
        self._waiting: dict[Any, tuple[float, list[tuple[str, Trajectory]]]] = {}
        self._handed_out: OrderedDict[str, None] = OrderedDict()  # yielded, not yet marked trained
        # held claims are renewed this often (a quarter of the shorter lease: ours, or another trainer's default)
        self.renew_s = min(lease_s, DEFAULT_LEASE_S) / 4
        self._renewed = time.monotonic()

    async def rollout(self, model: Any, group: TrajectoryGroup) -> TrajectoryGroup:
        """The pipeline's rollout: the group was rolled out in production already."""
        if self.model is None:
            self.model = model  # asked for its step from now on
        if self.max_staleness is not None:
            self.current_step = await model.get_step()
        return group

    async def on_step(self, report: Any, batch: list[TrajectoryGroup]) -> None:
        """Mark the step's trajectories trained (they will not be claimed again)."""
        ids = [str(t.metadata["trajectory_id"]) for g in batch for t in g.trajectories]
        await asyncio.to_thread(self.store.mark_trained, ids)
        for trajectory_id in ids:
            self._handed_out.pop(trajectory_id, None)

    def __aiter__(self) -> AsyncIterator[TrajectoryGroup]:
        return self.groups()

    async def groups(self) -> AsyncIterator[TrajectoryGroup]:
        if self.max_staleness is not None and self.model is None and self.current_step is None:
            raise ValueError(
                "StoreSource(max_staleness=...) checks each trajectory against the model's current step: "
                "pass model= (or set current_step before iterating)"
            )
        last_reward = time.monotonic()
        while True:
            await self._refresh_step()
            unreadable = len(self.store.unreadable)
            claimed = await asyncio.to_thread(self.store.claim, self.claim_size, self.lease_s)
            self.stats.skipped_unreadable += len(self.store.unreadable) - unreadable
            now = time.monotonic()
            held = {i for _, members in self._waiting.values() for i, _ in members}
            new = False
            done: list[str] = []
            for trajectory_id, trajectory in claimed:
                if trajectory_id in held or trajectory_id in self._handed_out:
                    continue  # its lease ran out while we held it: one trajectory is never twice in our hands
                self.stats.trajectories += 1
                last_reward, new = now, True
                value = key_of(trajectory, self.key)
                if not has_reward(trajectory):  # its body says no reward came, and the store joined none
                    self.stats.skipped_no_reward += 1
                    done.append(trajectory_id)
                elif value is None:
                    self.stats.skipped_unkeyed += 1
                    done.append(trajectory_id)
                elif self._stale(trajectory):
                    self.stats.skipped_stale += 1
                    done.append(trajectory_id)
                else:
                    self._waiting.setdefault(value, (now, []))[1].append((trajectory_id, trajectory))
                    held.add(trajectory_id)
            if any(len(members) >= self.min_size for _, members in self._waiting.values()):
                await self._refresh_step()  # what waited may have gone stale while the model trained
            for value in list(self._waiting):
                since, members = self._waiting.pop(value)
                fresh = [(i, t) for i, t in members if not self._stale(t)]
                if len(fresh) < len(members):
                    self.stats.skipped_stale += len(members) - len(fresh)
                    done += [i for i, t in members if self._stale(t)]
                members = fresh
                while len(members) >= self.min_size:
                    chunk, members = members[: self.max_size], members[self.max_size :]
                    self.stats.groups += 1
                    self.stats.grouped += len(chunk)
                    for trajectory_id, _ in chunk:
                        self._handed_out[trajectory_id] = None
                        while len(self._handed_out) > MAX_HANDED_OUT:
                            self._handed_out.popitem(last=False)
                    await asyncio.sleep(0)  # a consumer that never awaits still lets the event loop run
                    yield TrajectoryGroup([t for _, t in chunk], metadata={"key": str(value)[:200]})
                if members and now - since > self.wait_s:
                    self.stats.skipped_alone += len(members)
                    done += [i for i, _ in members]
                elif members:
                    self._waiting[value] = (since, members)
            if done:
                await asyncio.to_thread(self.store.mark_trained, done)
            await self._renew()
            if self.idle_s is not None and time.monotonic() - last_reward > self.idle_s:
                waiting = [i for _, members in self._waiting.values() for i, _ in members]
                await asyncio.to_thread(self.store.release, waiting)
                self._waiting.clear()
                return
            await asyncio.sleep(0 if new else self.poll_s)

    async def _refresh_step(self) -> None:
        if self.max_staleness is not None and self.model is not None:
            self.current_step = await self.model.get_step()

    async def _renew(self) -> None:
        """Keep the claims of what waits for partners (and of what was handed out, not yet trained) from lapsing:
        renewed every `renew_s`."""
        if time.monotonic() - self._renewed < self.renew_s:
            return
        self._renewed = time.monotonic()
        held = [i for _, members in self._waiting.values() for i, _ in members] + list(self._handed_out)
        await asyncio.to_thread(self.store.renew, held)

    def _stale(self, trajectory: Trajectory) -> bool:
        if self.current_step is None or self.max_staleness is None:
            return False
        version = sampled_version(trajectory)
        return version is not None and self.current_step - version > self.max_staleness
