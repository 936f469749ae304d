"""ART's `art.pipeline_trainer` face: `PipelineTrainer(model, backend, rollout_fn, scenarios, config, ...)` on our
async loop (`art_adapters.pipeline`). ART main's `pipeline=PipelineRuntimeConfig(...)` and the older direct
keywords (`num_rollout_workers=`, `min_batch_size=`, `max_steps_off_policy=`, ...) both map one to one; settings we
cannot honour raise `UnsupportedARTSetting`, nothing is silently ignored (status-output knobs only shape ART's log
lines and its `objective/score` metric, which we do not compute)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from ..backend.base import Backend
from ..compat import UnsupportedARTSetting, train_config
from ..model import TrainableModel
from ..pipeline import Pipeline, PipelineConfig
from ..pipeline_tuner import PipelineRuntimeConfig
from ..trajectories import Trajectory, TrajectoryGroup

ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")
RolloutFn = Callable[[TrainableModel, Any, Any], Awaitable[TrajectoryGroup]]
SingleRolloutFn = Callable[[TrainableModel, Any, Any], Awaitable[Trajectory]]
EvalFn = Callable[[TrainableModel, int, Any], Awaitable[Any]]
_UNSET: Any = object()


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn, n: int = 4) -> RolloutFn:
    """A group rollout from a single-trajectory one: `n` rollouts of the scenario at once (failures kept as the
    group's exceptions)."""

    async def group_rollout(model: TrainableModel, scenario: Any, config: Any) -> TrajectoryGroup:
        results = await asyncio.gather(
            *(single_rollout_fn(model, scenario, config) for _ in range(n)), return_exceptions=True
        )
        return TrajectoryGroup(results)

    return group_rollout


# ART's settings that change nothing here at their default, and the value that is their default.
_DEFAULT_ONLY: dict[str, Any] = {
    "loss_fn_config": None,
    "adam_params": None,
    "kl_penalty_step_lag": None,
    "megatron_topology": None,
    "save_checkpoint": True,
    "checkpoint_retention_strategy": None,
    "limit_mean_steps_off_policy": None,
    "score_reference_groups_per_step": None,
    "score_reference_rollouts_per_group": None,
    "autotune": None,
    "rollout_executor": None,
    "grad_accumulation_sequences": None,
}
# Knobs of ART's status lines (how often, how smoothed): our log is one line per step.
_STATUS_ONLY = {"log_interval_seconds", "status_ewa_alpha", "total_scenarios", "checkpoint_retention_interval",
                "optimizer_save_interval", "score_reference_groups_per_step",
                "score_reference_rollouts_per_group"}  # fmt: skip


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """Async 3-stage pipeline (rollouts, training, eval) as ART's, on any of our backends (a plain LocalBackend
    on CPU included: trainer and engine run side by side)."""

    def __init__(
        self,
        model: TrainableModel,
        backend: Backend,
        rollout_fn: RolloutFn,
        scenarios: AsyncIterator[Any] | Iterable[Any],
        config: Any,
        eval_fn: EvalFn | None = None,
        *,
        pipeline: PipelineRuntimeConfig | None = None,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        queue_maxsize: int | None = None,
        max_steps_off_policy: int | None = _UNSET,
        learning_rate: float = 1e-5,
        loss_fn: str = "cispo",
        normalize_advantages: bool = True,
        packed_sequence_length: int | None = None,
        kl_penalty_coef: float = 0.0,
        max_steps: int | None = None,
        discard_queue_multiplier: int = 100,
        eval_every_n_steps: int = 20,
        eval_at_start: bool = True,
        resume: bool = True,
        **settings: Any,
    ) -> None:
        for key, value in settings.items():
            if key in _STATUS_ONLY:
                continue
            if key not in _DEFAULT_ONLY:
                raise TypeError(f"PipelineTrainer() got an unexpected keyword argument {key!r}")
            if value != _DEFAULT_ONLY[key]:
                raise UnsupportedARTSetting(
                    f"PipelineTrainer: ART's {key}={value!r} is not supported by art-adapters (only "
                    f"{_DEFAULT_ONLY[key]!r}); see docs/porting.md"
                )
        runtime = _runtime(
            pipeline,
            {
                "num_rollout_workers": num_rollout_workers,
                "min_batch_size": min_batch_size,
                "max_batch_size": max_batch_size,
                "queue_maxsize": queue_maxsize,
                "max_steps_off_policy": max_steps_off_policy,
            },
        )
        if runtime.max_steps_off_policy is None:
            raise UnsupportedARTSetting(
                "PipelineTrainer: max_steps_off_policy=None (unbounded) is not supported: give a bound"
            )
        if discard_queue_multiplier <= 0:
            raise ValueError("discard_queue_multiplier must be > 0")
        self.model = model
        self.backend = backend
        self.rollout_fn = rollout_fn
        self.scenarios = scenarios
        self.config = config
        self.eval_fn = eval_fn
        self.eval_every_n_steps = eval_every_n_steps
        self.eval_at_start = eval_at_start
        self.resume = resume
        self.runtime = runtime
        knobs: dict[str, Any] = {"learning_rate": learning_rate, "loss_fn": loss_fn}
        if not normalize_advantages:
            knobs["normalize_advantages"] = False
        if packed_sequence_length is not None:
            knobs["packed_sequence_length"] = packed_sequence_length
        if kl_penalty_coef:
            knobs["kl_penalty_coef"] = kl_penalty_coef
        self.train_config = train_config(model.train_defaults(None), knobs, where="PipelineTrainer")
        self.pipeline_config = PipelineConfig(
            rollout_workers=runtime.num_rollout_workers,
            groups_per_step=runtime.min_batch_size,
            max_groups_per_step=runtime.max_batch_size or runtime.min_batch_size,
            max_steps_off_policy=runtime.max_steps_off_policy,
            queue_size=runtime.queue_maxsize,
            max_steps=max_steps,
            eval_every_n_steps=eval_every_n_steps if eval_fn is not None else 0,
            eval_at_start=eval_at_start and eval_fn is not None,
            max_zero_variance_groups=discard_queue_multiplier * runtime.min_batch_size,
        )
        self._pipeline: Pipeline[Any] | None = None

    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the pipeline over the scenarios (SIGINT/SIGTERM finish the step under way, then stop)."""
        if self.model._backend is not self.backend:
            await self.model.register(self.backend)

        async def rollout(model: TrainableModel, scenario: Any) -> TrajectoryGroup:
            return await self.rollout_fn(model, scenario, self.config)

        trains_on = getattr(self.eval_fn, "trains_on", None)  # an art.Evaluation: its training ids are known
        if callable(trains_on):
            trains_on(self.scenarios)

        async def evaluate(model: TrainableModel, step: int) -> Any:
            assert self.eval_fn is not None
            return await self.eval_fn(model, step, self.config)

        self._pipeline = Pipeline(
            self.model,
            rollout,
            self.scenarios,
            config=self.train_config,
            pipeline=self.pipeline_config,
            eval_fn=evaluate if self.eval_fn is not None else None,
            resume=self.resume,
        )
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self.request_stop)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
        try:
            await self._pipeline.run()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def request_stop(self) -> None:
        """Finish the step under way, then stop."""
        if self._pipeline is not None:
            self._pipeline.stop()

    @property
    def state(self) -> Pipeline[Any] | None:
        """The running pipeline (its counters: `state.state.discarded_stale_groups`, `scenario_offset`, ...)."""
        return self._pipeline


def _runtime(pipeline: PipelineRuntimeConfig | None, direct: dict[str, Any]) -> PipelineRuntimeConfig:
    """ART main's `pipeline=` or the older direct keywords (not both); `max_steps_off_policy=` was a direct keyword
    beside `pipeline=` in some ART versions, so it may come either way (but not two different values)."""
    bound = direct.pop("max_steps_off_policy")
    given = {k: v for k, v in direct.items() if v is not None}
    if pipeline is not None and given:
        raise ValueError(
            f"Use either pipeline=PipelineRuntimeConfig(...) or the direct settings {sorted(given)}, not both."
        )
    runtime = pipeline or PipelineRuntimeConfig(**given)
    if bound is _UNSET:
        return runtime
    if "max_steps_off_policy" in runtime.model_fields_set and runtime.max_steps_off_policy != bound:
        raise ValueError(
            f"max_steps_off_policy={bound!r} contradicts pipeline=PipelineRuntimeConfig(max_steps_off_policy="
            f"{runtime.max_steps_off_policy!r}): give it once"
        )
    return runtime.model_copy(update={"max_steps_off_policy": bound})


__all__ = [
    "EvalFn",
    "PipelineRuntimeConfig",
    "PipelineTrainer",
    "RolloutFn",
    "ScenarioT",
    "SingleRolloutFn",
    "make_group_rollout_fn",
]
