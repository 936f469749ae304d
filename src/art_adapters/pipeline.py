"""Rollouts never wait for training: the async off-policy loop, on any Backend (ART's PipelineTrainer, our way).

    rollout workers ──groups──► bounded queue ──batch──► trainer ──new version──► the backend serves it

`rollout_workers` tasks each take the next scenario and run `rollout(model, scenario) -> TrajectoryGroup` against
the model's served name, which always means its newest version; a rollout starts only while the policy it would
sample is at most `max_steps_off_policy` steps behind the step being trained, and a group older than that when the
trainer takes it is dropped (counted as `discarded_stale_groups`). The trainer takes `groups_per_step` groups (more,
up to `max_groups_per_step`, if they are already waiting), trains one step on them (the loss corrects each stale
token against the policy that sampled it: see training/loss.py) and logs the batch with ART's pipeline metrics.
Progress (scenarios consumed) lives in the model's state, so a run killed at any moment resumes where its last
step left it. With max_steps_off_policy=0 every group is sampled by the policy it trains: the synchronous loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .config import TrainConfig
from .model import TrainableModel
from .trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)
S = TypeVar("S")
RolloutFn = Callable[[TrainableModel, Any], Awaitable[TrajectoryGroup]]
EvalFn = Callable[[TrainableModel, int], Awaitable[Any]]
OnStep = Callable[["StepReport", list[TrajectoryGroup]], Awaitable[Any]]
STATE_KEY = "_pipeline_trainer"  # ART's key in the model's state, so its runs and ours resume alike


class PipelineConfig(BaseModel):
    """How the pipeline overlaps rollouts and training (ART's PipelineTrainer knobs, named as ours)."""

    model_config = ConfigDict(extra="forbid")

    rollout_workers: int = Field(4, ge=1, description="Groups being rolled out at once.")
    groups_per_step: int = Field(
        4, ge=1, description="A step waits for this many groups (ART: min_batch_size)."
    )
    max_groups_per_step: int | None = Field(
        None, ge=1, description="...and takes up to this many already waiting (default: groups_per_step)."
    )
    max_steps_off_policy: int = Field(
        1, ge=0, description="How far behind the trained step a sampling policy may be; 0 is synchronous."
    )
    queue_size: int | None = Field(
        None,
        ge=1,
        description="Finished groups waiting for the trainer (default: enough for the bound above).",
    )
    max_steps: int | None = Field(
        None, ge=0, description="Steps to train in this run (None: until scenarios end)."
    )
    eval_every_n_steps: int = Field(0, ge=0, description="Run `eval_fn` every N steps (0: never).")
    max_failed_groups: int = Field(
        16, ge=1, description="Consecutive groups with no trajectory before the run stops on their error."
    )
    max_zero_variance_groups: int | None = Field(
        None,
        ge=1,
        description="Stop once this many groups had equal rewards (a collapsed policy; ART's failsafe). None: never.",
    )

    @property
    def batch_cap(self) -> int:
        return max(self.max_groups_per_step or self.groups_per_step, self.groups_per_step)

    @property
    def queue_cap(self) -> int:
        return self.queue_size or max(1, self.max_steps_off_policy + 1) * self.batch_cap


class StepReport(BaseModel):
    """What one pipeline step trained on and how the pipeline spent its time (also written to history.jsonl)."""

    step: int
    groups: int
    metrics: dict[str, float]


class Pipeline(Generic[S]):
    """One async training run: `await Pipeline(model, rollout, scenarios, ...).run()` (or `train_async(...)`)."""

    def __init__(
        self,
        model: TrainableModel,
        rollout: RolloutFn,
        scenarios: Iterable[S] | AsyncIterable[S],
        *,
        config: TrainConfig | None = None,
        pipeline: PipelineConfig | None = None,
        eval_fn: EvalFn | None = None,
        train: Callable[[list[TrajectoryGroup]], Awaitable[tuple[int, dict[str, float]]]] | None = None,
        resume: bool = True,
        on_step: OnStep | None = None,
    ) -> None:
        self.model = model
        self.rollout = rollout
        self.scenarios = _aiter(scenarios)
        self.config = config or TrainConfig()
        self.pipeline = pipeline or PipelineConfig()
        self.eval_fn = eval_fn
        self.train_step = train or self._train_with_backend
        self.resume = resume
        self.on_step = on_step
        self.reports: list[StepReport] = []
        self.policy_version = 0  # the newest version being served (rollouts started now sample it)
        self.training_step = 0  # the step the trainer is producing (policy_version + 1 while a step runs)
        self.scenario_offset = 0
        self.discarded_stale_groups = 0
        self.zero_variance_groups = 0
        self.failed_groups = 0
        self.rollout_errors = 0
        self._outstanding = 0  # groups started and not yet taken by the trainer
        self._done = False
        self._queue: asyncio.Queue[TrajectoryGroup | None] = asyncio.Queue(self.pipeline.queue_cap)
        self._policy = asyncio.Condition()
        self._scenario_lock = asyncio.Lock()
        self._actor_idle_s = 0.0
        self._failure: BaseException | None = None

    # ---- the run ------------------------------------------------------------------------------------------------

    async def run(self) -> list[StepReport]:
        """Roll out and train until `max_steps`, the scenarios' end, or `stop()`; returns each step's report."""
        start = await self.model.get_step()
        state = (self.model.read_state() or {}).get(STATE_KEY, {}) if self.resume else {}
        self.policy_version = self.training_step = start
        # resume: skip the scenarios earlier runs consumed up to the step the backend holds (noted before that step
        # trained, so a run killed between its checkpoint and its log resumes exactly there)
        offset = (state.get("offsets") or {}).get(str(start), state.get("scenario_offset", 0))
        logged = max(int(state.get("training_step", start)), self._last_logged_step())
        for lost in range(logged + 1, start + 1):  # its checkpoint was saved, its row never written: say so
            await self.model.log(None, split="train", step=lost, metrics={"metrics_lost_in_crash": 1.0})
        for _ in range(int(offset or 0)):
            if await anext(self.scenarios, None) is None:
                break
            self.scenario_offset += 1
        workers = [asyncio.create_task(self._worker(i)) for i in range(self.pipeline.rollout_workers)]
        try:
            await self._trainer(start)
        finally:
            self.stop()
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if self._failure is not None:
            raise self._failure
        return self.reports

    def _last_logged_step(self) -> int:
        """The newest train row in the model's local history (a run can die between its log and its state)."""
        from .training.checkpoints import model_dir, read_history

        directory = model_dir(self.model.project, self.model.name, self.model.base_path)
        return max((int(r["step"]) for r in read_history(directory) if r.get("split") == "train"), default=-1)

    def stop(self) -> None:
        """Finish the step under way, then end the run (rollouts in flight are cancelled)."""
        self._done = True
        if self._queue.empty():
            self._queue.put_nowait(None)  # wake a trainer waiting for groups

    # ---- rollout workers ----------------------------------------------------------------------------------------

    def _may_start(self) -> bool:
        """Whether a rollout started now will be trained within the staleness bound: the groups already started
        and not yet trained fill the next steps first, `groups_per_step` each."""
        ahead = self.training_step - self.policy_version + self._outstanding // self.pipeline.groups_per_step
        return ahead <= self.pipeline.max_steps_off_policy

    async def _worker(self, index: int) -> None:
        while not self._done:
            waited = time.monotonic()
            async with self._policy:  # never sample a policy the trainer would have to drop
                await self._policy.wait_for(lambda: self._done or self._may_start())
                if self._done:
                    break
                self._outstanding += 1
                sampled_from = self.policy_version
            self._actor_idle_s += time.monotonic() - waited
            async with self._scenario_lock:
                scenario = await anext(self.scenarios, None)
                if scenario is not None:
                    self.scenario_offset += 1
            if scenario is None:
                await self._consumed(1)
                break
            group = await self._rollout(index, scenario)
            if group is None:
                await self._consumed(1)
                continue
            _stamp_versions(group, sampled_from, self.policy_version)
            waited = time.monotonic()
            await self._queue.put(group)
            self._actor_idle_s += time.monotonic() - waited
        await self._queue.put(
            None
        )  # this worker is done: the trainer stops once all are and the queue is empty

    async def _rollout(self, index: int, scenario: Any) -> TrajectoryGroup | None:
        try:
            group = await self.rollout(self.model, scenario)
        except Exception as error:  # a failing rollout never kills the run
            self.rollout_errors += 1
            log.warning("rollout worker %d: the rollout failed: %s: %s", index, type(error).__name__, error)
            return None
        if not isinstance(group, TrajectoryGroup):
            self.rollout_errors += 1
            log.warning(
                "rollout worker %d: the rollout returned %s, not a TrajectoryGroup", index, type(group)
            )
            return None
        return group

    async def _consumed(self, groups: int) -> None:
        async with self._policy:
            self._outstanding -= groups
            self._policy.notify_all()

    # ---- the trainer --------------------------------------------------------------------------------------------

    async def _trainer(self, start: int) -> None:
        stop_at = start + self.pipeline.max_steps if self.pipeline.max_steps is not None else None
        finished_workers = 0
        step = start
        while not self._done and (stop_at is None or step < stop_at):
            began = time.monotonic()
            batch: list[TrajectoryGroup] = []
            while len(batch) < self.pipeline.groups_per_step or (
                len(batch) < self.pipeline.batch_cap and not self._queue.empty()
            ):
                group = await self._queue.get()
                if group is None:
                    finished_workers += 1
                    if self._done or finished_workers >= self.pipeline.rollout_workers:
                        break
                    continue
                await self._consumed(1)
                if self._usable(group, step):
                    batch.append(group)
                if self._done:
                    break
            if not batch or self._done:
                break
            waited_s = time.monotonic() - began
            async with self._policy:
                self.training_step = step + 1
                self._policy.notify_all()
            self.model.merge_state({STATE_KEY: {"offsets": {str(step + 1): self.scenario_offset}}})
            trained = time.monotonic()
            step, metrics = await self.train_step(batch)
            trainer_s = time.monotonic() - trained
            async with self._policy:
                self.policy_version = self.training_step = step
                self._policy.notify_all()
            metrics = {**metrics, **self._pipeline_metrics(batch, step, began, waited_s, trainer_s)}
            await self.model.log(batch, split="train", step=step, metrics=metrics)
            self.model.merge_state(
                {STATE_KEY: {"scenario_offset": self.scenario_offset, "training_step": step}}
            )
            self.reports.append(StepReport(step=step, groups=len(batch), metrics=metrics))
            if self.on_step is not None:
                await self.on_step(self.reports[-1], batch)
            if self.eval_fn is not None and self.pipeline.eval_every_n_steps:
                if (step - start) % self.pipeline.eval_every_n_steps == 0:
                    evaluated = await self.eval_fn(self.model, step)
                    if evaluated:
                        await self.model.log(evaluated, split="val", step=step)

    def _usable(self, group: TrajectoryGroup, step: int) -> bool:
        """Whether a finished group trains this step: not too stale, not all failed, some reward signal."""
        if not group.trajectories:
            self.failed_groups += 1
            if self.failed_groups >= self.pipeline.max_failed_groups and group.exceptions:
                first = group.exceptions[0]
                self._failure = RuntimeError(
                    f"{self.failed_groups} groups failed in a row: {first.type}: {first.message}"
                )
                self.stop()
            return False
        self.failed_groups = 0
        if _initial_version(group, step) < step - self.pipeline.max_steps_off_policy:
            self.discarded_stale_groups += 1
            return False
        if _no_signal(group):
            self.zero_variance_groups += 1
            limit = self.pipeline.max_zero_variance_groups
            if limit is not None and self.zero_variance_groups == limit:
                log.error(
                    "%d groups had equal rewards for every trajectory: the policy may have collapsed; stopping "
                    "(lower the learning rate, or check the reward's variance)",
                    self.zero_variance_groups,
                )
                self.stop()
            return False
        return True

    def _pipeline_metrics(
        self, batch: list[TrajectoryGroup], step: int, began: float, waited_s: float, trainer_s: float
    ) -> dict[str, float]:
        """ART's pipeline metrics (`train/...` once logged) and ours."""
        off = [step - 1 - _initial_version(g, step - 1) for g in batch]
        actor_idle, self._actor_idle_s = self._actor_idle_s, 0.0
        return {
            "steps_off_policy": sum(off) / len(off),
            "max_steps_off_policy": float(max(off)),
            "discarded_stale_groups": float(self.discarded_stale_groups),
            "zero_variance_groups": float(self.zero_variance_groups),
            "rollout_errors": float(self.rollout_errors),
            "time/step_wall_s": time.monotonic() - began,
            "time/step_trainer_s": trainer_s,
            "throughput/step_trainer_idle_s": waited_s,
            "throughput/step_actor_idle_s": actor_idle,
        }

    async def _train_with_backend(self, batch: list[TrajectoryGroup]) -> tuple[int, dict[str, float]]:
        done: dict[str, Any] = {}
        async for event in self.model.backend().train_events(self.model, batch, self.config, record=False):
            if event.get("event") == "done":
                done = event
        metrics = {k: float(v) for k, v in done.get("metrics", {}).items() if isinstance(v, int | float)}
        return int(done["step"]), metrics


async def train_async(
    model: TrainableModel,
    rollout: RolloutFn,
    scenarios: Iterable[Any] | AsyncIterable[Any],
    *,
    config: TrainConfig | None = None,
    pipeline: PipelineConfig | None = None,
    eval_fn: EvalFn | None = None,
    resume: bool = True,
    on_step: OnStep | None = None,
) -> list[StepReport]:
    """Train `model` with rollouts that never wait for training (see the module docstring); `on_step(report,
    batch)` runs after each step."""
    return await Pipeline(
        model,
        rollout,
        scenarios,
        config=config,
        pipeline=pipeline,
        eval_fn=eval_fn,
        resume=resume,
        on_step=on_step,
    ).run()


# ---- versions -------------------------------------------------------------------------------------------------


def _stamp_versions(group: TrajectoryGroup, started: int, ended: int) -> None:
    """Each trajectory's first and last sampling policy: from its captured calls where the server said, else the
    versions served when its rollout began and ended (ART's rule)."""
    for trajectory in group.trajectories:
        versions = _call_versions(trajectory)
        if trajectory.initial_policy_version is None:
            trajectory.initial_policy_version = min(versions, default=started)
        if trajectory.final_policy_version is None:
            trajectory.final_policy_version = max(versions, default=ended)


def _call_versions(trajectory: Trajectory) -> list[int]:
    return [c.policy_version for c in trajectory.llm_calls if c.policy_version is not None]


def _initial_version(group: TrajectoryGroup, default: int) -> int:
    versions = [t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None]
    return min(versions, default=default)


def _no_signal(group: TrajectoryGroup) -> bool:
    """All rewards equal (overall and per role): the group's advantages are all zero."""
    rewards = [t.reward for t in group.trajectories]
    if len(set(rewards)) > 1:
        return False
    roles = {role for t in group.trajectories for role in t.rewards_by_role}
    return all(len({t.rewards_by_role.get(r, t.reward) for t in group.trajectories}) <= 1 for r in roles)


async def _aiter_of(items: Iterable[S]) -> AsyncIterator[S]:
    for item in items:
        yield item


def _aiter(items: Iterable[S] | AsyncIterable[S]) -> AsyncIterator[S]:
    if isinstance(items, AsyncIterable):
        return aiter(items)
    return _aiter_of(items)
