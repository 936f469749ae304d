"""One async training run: rollout workers, the trainer and the evaluator as tasks under one supervisor. The run
ends when `max_steps` are trained, the scenarios run dry (the last partial batch trains), or `stop()`; a stage that
fails ends it at once, re-raising that stage's error with a note naming it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..config import TrainConfig
from ..model import TrainableModel
from ..trajectories import TrajectoryGroup
from .config import PipelineConfig, StepReport
from .groups import SOURCE_DRY, as_async_iterator, eval_splits, no_signal
from .metrics import StepTiming, step_metrics
from .state import PipelineState, last_logged_step, saved_state
from .versions import check_not_future, group_version, own_names, stamp_versions

log = logging.getLogger("art_adapters.pipeline")
S = TypeVar("S")
RolloutFn = Callable[[TrainableModel, Any], Awaitable[TrajectoryGroup]]
EvalFn = Callable[[TrainableModel, int], Awaitable[Any]]
OnStep = Callable[[StepReport, list[TrajectoryGroup]], Awaitable[Any]]
TrainStep = Callable[[list[TrajectoryGroup]], Awaitable[tuple[int, dict[str, float]]]]
DISCARDED_LOGGED = 50  # zero-variance groups written to the `discarded` split per step, at most (as ART)


@dataclass
class _Finished:
    group: TrajectoryGroup
    rollout_s: float


class Pipeline(Generic[S]):
    """`await Pipeline(model, rollout, scenarios, ...).run()` (or `train_async(...)`); see the package docstring."""

    def __init__(
        self,
        model: TrainableModel,
        rollout: RolloutFn,
        scenarios: Iterable[S] | AsyncIterable[S],
        *,
        config: TrainConfig | None = None,
        pipeline: PipelineConfig | None = None,
        eval_fn: EvalFn | None = None,
        train: TrainStep | None = None,
        resume: bool = True,
        on_step: OnStep | None = None,
    ) -> None:
        self.model = model
        self.rollout = rollout
        self.scenarios = as_async_iterator(scenarios)
        # a source that keeps its own progress (a trajectory store) is not skipped into on resume
        self.skips_on_resume = not getattr(scenarios, "resumes_itself", False)
        self.config = config or TrainConfig()
        self.pipeline = pipeline or PipelineConfig()
        self.eval_fn = eval_fn
        self.train_step = train or self._train_with_backend
        self.resume = resume
        self.on_step = on_step
        self.reports: list[StepReport] = []
        self.state = PipelineState()
        self.names = own_names(model)
        self.collapsed = False  # stopped by the zero-variance failsafe
        self.eval_errors = 0
        self._done = False  # stop requested (or collapse): finish the step under way, then end
        self._exhausted = False  # the scenarios ran dry
        self._workers_left = self.pipeline.rollout_workers
        self._outstanding = 0  # groups started and not yet taken by the trainer
        self._collected = 0  # groups in the batch the trainer is collecting
        self._finished: deque[_Finished] = deque()
        self._changed = asyncio.Event()  # set (and replaced) whenever any of the above changes
        self._scenario_lock = asyncio.Lock()
        self._zero_variance: list[TrajectoryGroup] = []  # since the last step (ART's discard queue)
        self._failed_in_row = 0
        self._draining: asyncio.Task[None] | None = None  # the evaluator, once training has ended
        self._rollout_idle_s = 0.0
        self._queue_wait_s = 0.0
        self._evals: asyncio.Queue[int | None] = asyncio.Queue()
        self._scheduled_evals: set[int] = set()

    # ---- the run ------------------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.state.policy_version

    @property
    def scenario_offset(self) -> int:
        return self.state.scenario_offset

    @property
    def discarded_stale_groups(self) -> int:
        return self.state.discarded_stale_groups

    async def run(self) -> list[StepReport]:
        """Roll out and train until `max_steps`, the scenarios' end, or `stop()`; returns each step's report."""
        start = await self.model.get_step()
        saved = saved_state(self.model) if self.resume else {}
        offset = self.state.restore(saved, start)
        logged = max(int(saved.get("training_step", start)), last_logged_step(self.model))
        for lost in range(logged + 1, start + 1):  # its checkpoint was saved, its row never written: say so
            await self.model.log(None, split="train", step=lost, metrics={"metrics_lost_in_crash": 1.0})
        if self.skips_on_resume:
            await self._skip(offset)
        self._warn_if_rollouts_pause()
        if self.eval_fn is not None and self.pipeline.eval_at_start:
            self._schedule_eval(start)
        workers = [
            asyncio.create_task(self._worker(i), name=f"rollout worker {i}")
            for i in range(self.pipeline.rollout_workers if self.pipeline.max_steps != 0 else 0)
        ]
        trainer = asyncio.create_task(self._trainer(start), name="trainer")
        evaluator = asyncio.create_task(self._evaluator(), name="evaluator")
        try:
            await self._supervise(trainer, workers, evaluator)
            self.model.merge_state(self.state.persisted(self.state.policy_version))
        finally:
            self.stop()
            self._evals.put_nowait(None)  # the evaluator ends even if a cancellation were lost under it
            for task in (*workers, trainer, evaluator):
                task.cancel()
            await asyncio.gather(*workers, trainer, evaluator, return_exceptions=True)
        return self.reports

    async def _supervise(
        self, trainer: asyncio.Task[None], workers: list[asyncio.Task[None]], evaluator: asyncio.Task[None]
    ) -> None:
        """Wait for the trainer to end; the first stage to fail ends the run with its error."""
        pending: set[asyncio.Task[None]] = {trainer, evaluator, *workers}
        while trainer in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    self.stop()
                    error.add_note(f"raised in the pipeline's {task.get_name()}")
                    raise error
        # evaluations already scheduled still run (as ART's), then the evaluator ends; stop() skips them
        self._evals.put_nowait(None)
        self._draining = evaluator
        if self._done:
            evaluator.cancel()
        try:
            await evaluator
        except asyncio.CancelledError:
            if _being_cancelled():
                raise
            log.warning("stopped: the evaluations still scheduled were skipped")

    def stop(self) -> None:
        """Finish the step under way, then end the run (rollouts in flight are cancelled)."""
        self._done = True
        if self._draining is not None:  # training has ended: only evaluations were left to wait for
            self._draining.cancel()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    async def _skip(self, offset: int) -> None:
        """Resume: skip the scenarios earlier runs consumed up to the step the backend holds."""
        for _ in range(offset):
            if await anext(self.scenarios, SOURCE_DRY) is SOURCE_DRY:
                log.warning("the scenarios ran out while skipping the %d a previous run consumed", offset)
                break
            self.state.scenario_offset += 1

    def _warn_if_rollouts_pause(self) -> None:
        pauses = getattr(self.model.backend(), "rollouts_pause_during_steps", None)
        if callable(pauses) and pauses(self.model):
            log.warning(
                "trainer and inference engine share a GPU: the engine sleeps while each step trains, so rollouts "
                "pause then and the pipeline overlaps little (ART refuses this mode); give each its own GPUs "
                "(LocalBackend(trainer_gpu_ids=...), InferenceConfig(gpu_ids=...)) to keep rollouts running"
            )

    # ---- rollout workers ----------------------------------------------------------------------------------------

    def _may_start(self) -> bool:
        """Whether a rollout started now will be trained within the staleness bound: the groups in the batch being
        collected and those started before it fill the next steps first, `groups_per_step` each."""
        state = self.state
        queued = self._collected + self._outstanding
        ahead = state.training_step - state.policy_version + queued // self.pipeline.groups_per_step
        return ahead <= self.pipeline.max_steps_off_policy

    async def _worker(self, index: int) -> None:
        try:
            while True:
                await asyncio.sleep(0)  # each pass yields, whatever the rollout did (one failing at once too)
                idle_from = time.monotonic()
                await self._until(lambda: self._done or self._exhausted or self._may_start())
                if self._done or self._exhausted:
                    return
                self._outstanding += 1  # reserved: released below unless the trainer takes the group
                self._rollout_idle_s += time.monotonic() - idle_from
                handed = False
                try:
                    sampled_from = self.state.policy_version
                    scenario = await self._next_scenario()
                    if scenario is SOURCE_DRY:
                        return
                    began = time.monotonic()
                    group = await self._rollout(index, scenario)
                    if group is None:
                        continue
                    stamp_versions(group, self.names, sampled_from, self.state.policy_version)
                    finished = _Finished(group, time.monotonic() - began)
                    waited = time.monotonic()
                    await self._until(lambda: self._done or len(self._finished) < self.pipeline.queue_cap)
                    if self._done:
                        return
                    self._finished.append(finished)
                    handed = True
                    self._queue_wait_s += time.monotonic() - waited
                    self._rollout_idle_s += time.monotonic() - waited
                    self._notify()
                finally:
                    if not handed:
                        self._outstanding -= 1
                        self._notify()
        finally:
            self._workers_left -= 1
            self._notify()

    async def _next_scenario(self) -> Any:
        async with self._scenario_lock:
            if self._exhausted:
                return SOURCE_DRY
            try:
                scenario = await anext(self.scenarios)
            except StopAsyncIteration:
                self._exhausted = True
                self._notify()
                return SOURCE_DRY
            except Exception as error:
                error.add_note("raised by the pipeline's scenario source")
                raise
            self.state.scenario_offset += 1
            self.state.total_scenarios_consumed += 1
            return scenario

    async def _rollout(self, index: int, scenario: Any) -> TrajectoryGroup | None:
        """The rollout's group, or None (counted, logged) when it raised, returned something else or no trajectory
        at all; `max_failed_groups` of those in a row end the run with the last one's error."""
        try:
            group = await self.rollout(self.model, scenario)
        except asyncio.CancelledError as error:
            if _being_cancelled():
                raise
            return self._failed(index, error)  # a cancellation leaked out of the rollout: a failure like any
        except Exception as error:
            return self._failed(index, error)
        if not isinstance(group, TrajectoryGroup):
            return self._failed(index, f"it returned {type(group).__name__}, not a TrajectoryGroup")
        if not group.trajectories:
            first = group.exceptions[0] if group.exceptions else None
            return self._failed(index, f"{first.type}: {first.message}" if first else "an empty group")
        self._failed_in_row = 0
        return group

    def _failed(self, index: int, error: BaseException | str) -> None:
        self.state.rollout_errors += 1
        self._failed_in_row += 1
        what = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        log.warning("rollout worker %d: the rollout failed: %s", index, what)
        if self._failed_in_row >= self.pipeline.max_failed_groups:
            raise RuntimeError(
                f"{self._failed_in_row} rollouts in a row produced no trajectory; the last: {what}"
            )
        return None

    # ---- the trainer --------------------------------------------------------------------------------------------

    async def _trainer(self, start: int) -> None:
        stop_at = start + self.pipeline.max_steps if self.pipeline.max_steps is not None else None
        step = start
        while not self._done and (stop_at is None or step < stop_at):
            began = time.monotonic()
            batch, stale, zero = await self._collect(step)
            if not batch or self._done:
                break
            collected = time.monotonic()
            self.state.training_step = step + 1
            self._notify()
            self.state.note_offset(self.model, step + 1)
            new_step, metrics = await self.train_step([f.group for f in batch])
            trained = time.monotonic()
            self.state.policy_version = self.state.training_step = new_step
            self.state.accepted_trainable_groups += len(batch)
            self._notify()
            idle, self._rollout_idle_s = self._rollout_idle_s, 0.0
            queue_wait, self._queue_wait_s = self._queue_wait_s, 0.0
            timing = StepTiming(
                wall_s=trained - began,
                collect_s=collected - began,
                train_s=trained - collected,
                rollout_s=sum(f.rollout_s for f in batch),
                rollout_idle_s=idle,
                queue_wait_s=queue_wait,
            )
            groups = [f.group for f in batch]
            metrics = {**metrics, **self._metrics(groups, step, stale, zero, timing)}
            await self.model.log(groups, split="train", step=new_step, metrics=metrics)
            if self._zero_variance:
                await self.model.log(self._zero_variance[:DISCARDED_LOGGED], split="discarded", step=new_step)
                self._zero_variance.clear()
            if self._eval_due(new_step):
                self._schedule_eval(new_step)
            self.model.merge_state(self.state.persisted(new_step))
            self.reports.append(StepReport(step=new_step, groups=len(batch), metrics=metrics))
            if self.on_step is not None:
                await self.on_step(self.reports[-1], groups)
            step = new_step

    def _metrics(
        self, groups: list[TrajectoryGroup], step: int, stale: int, zero: int, timing: StepTiming
    ) -> dict[str, float]:
        return step_metrics(
            groups,
            self.names,
            step,
            self.state,
            stale,
            zero,
            timing,
            [f.group for f in self._finished],
            self.pipeline.queue_cap,
            self.pipeline.max_steps_off_policy,
        )

    async def _collect(self, step: int) -> tuple[list[_Finished], int, int]:
        """The next batch for a step from version `step`: `groups_per_step` usable groups (more, up to the cap, if
        already waiting), fewer once no more will come. Returns it with the stale and zero-variance groups
        dropped on the way."""
        batch: list[_Finished] = []
        stale = zero = 0
        cap = self.pipeline.batch_cap
        while len(batch) < self.pipeline.groups_per_step or (len(batch) < cap and self._finished):
            await self._until(lambda: self._done or bool(self._finished) or not self._workers_left)
            if self._done or not self._finished:
                break
            finished = self._finished.popleft()
            self._outstanding -= 1
            self._notify()
            verdict = self._judge(finished.group, step)
            if verdict == "stale":
                stale += 1
            elif verdict == "zero":
                zero += 1
            elif verdict == "ok":
                batch.append(finished)
                self._collected = len(batch)
        self._collected = 0
        self._notify()
        return batch, stale, zero

    def _judge(self, group: TrajectoryGroup, step: int) -> str:
        """Whether a finished group trains this step: not all failed, not too stale, some reward signal."""
        if not group.trajectories:  # refused by the worker already
            return "failed"
        check_not_future(group, self.state.policy_version)
        if group_version(group, step) < step - self.pipeline.max_steps_off_policy:
            self.state.discarded_stale_groups += 1
            return "stale"
        if no_signal(group):
            self.state.discarded_zero_variance_groups += 1
            self._zero_variance.append(group)
            limit = self.pipeline.max_zero_variance_groups
            if limit is not None and len(self._zero_variance) >= limit:
                log.error(
                    "%d groups since the last step had equal rewards for every trajectory: the policy may have "
                    "collapsed; stopping (lower the learning rate, or check the reward's variance)",
                    len(self._zero_variance),
                )
                self.collapsed = True
                self.stop()
            return "zero"
        return "ok"

    async def _train_with_backend(self, batch: list[TrajectoryGroup]) -> tuple[int, dict[str, float]]:
        done: dict[str, Any] = {}
        async for event in self.model.backend().train_events(self.model, batch, self.config, record=False):
            if event.get("event") == "done":
                done = event
        if "step" not in done:
            raise RuntimeError("the backend's training step ended without reporting its new step")
        metrics = {k: float(v) for k, v in done.get("metrics", {}).items() if isinstance(v, int | float)}
        return int(done["step"]), metrics

    # ---- evaluation ---------------------------------------------------------------------------------------------

    def _eval_due(self, step: int) -> bool:
        every = self.pipeline.eval_every_n_steps
        last = self.state.last_eval_step if self.state.last_eval_step is not None else 0
        return self.eval_fn is not None and every > 0 and step - last >= every

    def _schedule_eval(self, step: int) -> None:
        if step not in self._scheduled_evals:
            self._scheduled_evals.add(step)
            self.state.last_eval_step = step
            self._evals.put_nowait(step)

    async def _evaluator(self) -> None:
        """Evaluate scheduled steps one at a time, beside training; a failing evaluation is logged, never fatal."""
        while (step := await self._evals.get()) is not None:
            assert self.eval_fn is not None
            began = time.monotonic()
            try:
                async with asyncio.timeout(
                    self.pipeline.eval_timeout_s
                ):  # not wait_for: 3.11's can lose a cancel
                    result = await self.eval_fn(self.model, step)
                timing: dict[str, float] | None = {"time/step_eval_s": time.monotonic() - began}
                for split, groups in eval_splits(result).items():
                    await self.model.log(groups, split=split, step=step, metrics=timing)
                    timing = None
            except asyncio.CancelledError as error:
                if _being_cancelled():
                    raise
                self.eval_errors += 1  # a cancellation leaked out of eval_fn: a failure like any
                log.warning("evaluation at step %d failed: %s", step, type(error).__name__)
                continue
            except Exception as error:
                self.eval_errors += 1
                log.warning("evaluation at step %d failed: %s: %s", step, type(error).__name__, error)
                continue
            self.state.completed_eval_steps.add(step)


def _being_cancelled() -> bool:
    """Whether this task is being cancelled (by the run's own shutdown), rather than a CancelledError leaking out
    of user code it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
