"""Rollouts never wait for training: the async off-policy loop, on any Backend (ART's PipelineTrainer, our way).

    rollout workers ──groups──► bounded queue ──batch──► trainer ──new version──► the backend serves it
                                                           └──step──► evaluator (name@step, beside training)

`rollout_workers` tasks each take the next scenario and run `rollout(model, scenario) -> TrajectoryGroup` against
the model's served name, which always means its newest version; a rollout starts only while the policy it would
sample is at most `max_steps_off_policy` steps behind the step being trained, and a group older than that when the
trainer takes it is dropped (`discarded/cum/stale_groups`). The trainer takes `groups_per_step` groups (more, up to
`max_groups_per_step`, if they are already waiting), trains one step on them (one loss for fresh and stale tokens:
see training/loss.py) and logs the batch with ART's pipeline metrics; groups whose rewards were all equal go to the
`discarded` split. Evaluation runs beside training and never ends the run. The run ends when `max_steps` are
trained, when the scenarios run dry (the last partial batch trains), or on `stop()`; a stage that fails (the
scenario source, the backend's step, `model.log`) ends it with that error within moments, every reservation
released. Progress and counters live in the model's state, so a run killed at any moment resumes where its last
step left it. With max_steps_off_policy=0 every group is sampled by the policy it trains: the synchronous loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from typing import Any

from ..config import TrainConfig
from ..evaluation.periodic import Evaluation
from ..model import TrainableModel
from .config import PipelineConfig, StepReport
from .groups import eval_splits
from .run import EvalFn, OnStep, Pipeline, RolloutFn
from .state import STATE_KEY
from .versions import FutureVersionError


async def train_async(
    model: TrainableModel,
    rollout: RolloutFn,
    scenarios: Iterable[Any] | AsyncIterable[Any],
    *,
    config: TrainConfig | None = None,
    pipeline: PipelineConfig | None = None,
    eval_fn: EvalFn | None = None,
    eval: Evaluation | None = None,
    resume: bool = True,
    on_step: OnStep | None = None,
) -> list[StepReport]:
    """Train `model` with rollouts that never wait for training (see the module docstring); `on_step(report,
    batch)` runs after each step; `eval_fn(model, step)` evaluates `model.get_inference_name(step=step)`.
    `eval=art.Evaluation(rollout, scenarios, ...)`: the evaluation harness at the steps `pipeline` schedules
    (`eval_every_n_steps`, `eval_at_start`), each logged with its interval and its gain over step 0; when
    `scenarios` is a list, its ids are the evaluation's `train_ids` (unless given)."""
    if eval is not None:
        if eval_fn is not None:
            raise ValueError("give train_async eval= or eval_fn=, not both")
        schedule = pipeline or PipelineConfig()
        if schedule.eval_every_n_steps == 0 and not schedule.eval_at_start:
            raise ValueError(
                "train_async(eval=...) would never evaluate: set PipelineConfig(eval_every_n_steps=N) "
                "and/or eval_at_start=True"
            )
        trains_on = getattr(
            eval, "trains_on", None
        )  # an art.Evaluation: its training scenarios are not held out
        if callable(trains_on):
            trains_on(scenarios)
        eval_fn = eval
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


__all__ = [
    "STATE_KEY",
    "EvalFn",
    "FutureVersionError",
    "OnStep",
    "Pipeline",
    "PipelineConfig",
    "RolloutFn",
    "StepReport",
    "eval_splits",
    "train_async",
]
