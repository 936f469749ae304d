"""`Evaluation`: the harness as a training run's evaluation (`train_async(..., eval=...)`, ART's
`PipelineTrainer(eval_fn=...)`): each evaluated step gets art.evaluate's statistics, compared with a baseline step
(step 0 by default, evaluated once and kept), logged as the step's metrics under the split, and published: the
report page follows every evaluated step, W&B and Langfuse get each new step once."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model import TrainableModel
from .harness import Rollout, Sampling, check_counts, evaluate, write_result
from .publish import Publisher, check_sinks, model_folder
from .results import Attempt, EvalResult, TargetSummary
from .scenarios import check_train_ids, known_ids, load_scenarios, with_ids
from .sinks import REPORT_PAGE
from .summarize import comparison
from .targets import Reference, step_label


@dataclass
class Evaluation:
    """What to evaluate at a step: `rollout` (the training rollout, unchanged) over `scenarios` (with ids),
    `attempts` each, with `sampling`. `baseline`: the step each evaluated step is compared with (None: none).
    `output_dir`: each step's full result as `step-{step:04d}.json`. `report`: after each step, the page
    evaluation.html (every evaluated step's reward, the newest step's comparisons and attempts) in the model's
    folder, else in `output_dir`. `wandb` (a WandbLogger or wandb Run): each step's `eval/...` metrics, with
    `eval/step` = the step as their axis. `langfuse` (a LangfuseExporter or langfuse.Langfuse): a dataset run per
    new step (the baseline and the references once). A sink that fails warns once. The other settings are
    art.evaluate's. Called as `await evaluation(model, step)`; `results` keeps every step's EvalResult."""

    rollout: Rollout
    scenarios: Sequence[Any] | str | Path
    attempts: int = 4
    sampling: Sampling | dict[str, Any] | None = None
    baseline: int | None = 0
    references: Sequence[Reference | dict[str, Any]] = ()
    success_threshold: float | None = None
    max_error_fraction: float = 0.1
    train_ids: Iterable[Any] | None = None
    split: str = "val"
    output_dir: str | Path | None = None
    report: bool = True
    wandb: Any = None
    langfuse: Any = None
    results: dict[int, EvalResult] = field(default_factory=dict, init=False)
    _baseline: tuple[TargetSummary, list[Attempt]] | None = field(default=None, init=False, repr=False)
    _kept_references: list[tuple[TargetSummary, list[Attempt]]] = field(
        default_factory=list, init=False, repr=False
    )
    _publisher: Publisher | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Bad settings fail when the run is set up, not at its first evaluation."""
        if isinstance(self.scenarios, str | Path):
            self.scenarios = load_scenarios(self.scenarios)
        self.scenarios = list(self.scenarios)
        with_ids(self.scenarios)
        check_counts(self.attempts, None, self.max_error_fraction, 1)
        if self.sampling is not None:  # None stays None: no settings asked for (as in art.evaluate)
            self.sampling = Sampling.of(self.sampling)
        if self.baseline is not None and (isinstance(self.baseline, bool) or self.baseline < 0):
            raise ValueError(f"baseline must be a step >= 0 or None, not {self.baseline!r}")
        self.train_ids = check_train_ids(self.train_ids)
        check_sinks(self.wandb, self.langfuse)

    def trains_on(self, scenarios: Any) -> None:
        """The run's training scenarios: when they are a list (known before training) and `train_ids` was not given,
        the ids of those that have one become `train_ids`, so evaluating any of them warns and marks the result not
        held out. A stream (a generator, an async source) is not read ahead."""
        if (
            self.train_ids is None
            and isinstance(scenarios, Sequence)
            and not isinstance(scenarios, str | bytes)
        ):
            ids = known_ids(scenarios)
            if ids:
                self.train_ids = ids

    async def __call__(self, model: TrainableModel, step: int, *_: Any) -> None:
        """Evaluate `step` (extra arguments, as ART's eval_fn gets its config, are ignored) and log its metrics."""
        result = await self.run(model, step)
        await model.log(None, split=self.split, metrics=step_metrics(result, step), step=step)

    async def run(self, model: TrainableModel, step: int) -> EvalResult:
        """`step` evaluated, with its comparisons to the baseline and the references. The baseline and the
        references do not change during training: they are evaluated once, the first time, and kept."""
        baseline = self.baseline if self.baseline != step else None
        new_baseline = baseline is not None and self._baseline is None
        new_references = bool(self.references) and not self._kept_references
        result = await evaluate(
            model,
            self.rollout,
            self.scenarios,  # type: ignore[arg-type]
            attempts=self.attempts,
            steps=[baseline, step] if new_baseline else [step],  # type: ignore[list-item]
            split=self.split,
            sampling=self.sampling,
            references=self.references if new_references else (),
            train_ids=self.train_ids,
            success_threshold=self.success_threshold,
            max_error_fraction=self.max_error_fraction,
            progress=False,
            report=False,  # published below, with what is kept
        )
        if self.baseline == step or new_baseline:  # keep what does not change
            label = step_label(self.baseline)  # type: ignore[arg-type]
            self._baseline = (result.target(label), [a for a in result.attempts if a.target == label])
        if new_references:
            for target in result.targets:
                if target.step is None:
                    kept = [a for a in result.attempts if a.target == target.target]
                    self._kept_references.append((target, kept))
        else:  # the kept ones join this step's result, compared with it as art.evaluate would
            ids = [sid for sid, _ in with_ids(self.scenarios)]  # type: ignore[arg-type]
            kept_targets = [(self._baseline, True)] if baseline is not None and not new_baseline else []
            kept_targets += [(kept, False) for kept in self._kept_references]
            for (summary, attempts), first in kept_targets:
                result.attempts = [*attempts, *result.attempts] if first else [*result.attempts, *attempts]
                result.targets = [summary, *result.targets] if first else [*result.targets, summary]
            pairs = [(t.target, step_label(step)) for t in result.targets if t.target != step_label(step)]
            result.comparisons = [comparison(result.attempts, a, b, ids) for a, b in pairs]
        self.results[step] = result
        if self.output_dir is not None:
            write_result(result, Path(self.output_dir) / f"step-{step:04d}.json")
        new = [step_label(step)] + ([step_label(self.baseline)] if new_baseline else [])  # type: ignore[arg-type]
        new += [t.target for t in result.targets if t.step is None] if new_references else []
        await self._publish(model, step, result, new)
        return result

    async def _publish(self, model: TrainableModel, step: int, result: EvalResult, new: list[str]) -> None:
        if not self.report and self.wandb is None and self.langfuse is None:
            return
        if self._publisher is None:
            folder = model_folder(model) or (Path(self.output_dir) if self.output_dir is not None else None)
            page = folder / REPORT_PAGE if self.report and folder is not None else None
            self._publisher = Publisher(page, self.wandb, self.langfuse)
        scenarios = dict(with_ids(self.scenarios))  # type: ignore[arg-type]
        page_view = training_view(self.results, step)
        publisher = self._publisher
        await asyncio.to_thread(publisher.publish_page, page_view)
        await asyncio.to_thread(publisher.publish_sinks, result, scenarios=scenarios, step=step, targets=new)


def training_view(results: Mapping[int, EvalResult], latest: int) -> EvalResult:
    """Step `latest`'s result with every other evaluated step's summary among its targets, so the page's reward
    chart follows training; its comparisons and attempts stay step `latest`'s."""
    view = dataclasses.replace(results[latest])
    have = {t.target for t in view.targets}
    others = [r.target(step_label(s)) for s, r in sorted(results.items()) if step_label(s) not in have]
    steps = sorted([t for t in view.targets if t.step is not None] + others, key=lambda t: t.step or 0)
    view.targets = steps + [t for t in view.targets if t.step is None]
    return view


def step_metrics(result: EvalResult, step: int) -> dict[str, float]:
    """The evaluated step's statistics as history metrics (the split prefix is added by `model.log`): reward and
    its interval, success rate, pass@k, errors, and the gain over the baseline with its interval and counts."""
    own = result.target(step_label(step))
    metrics: dict[str, float] = {
        "reward": own.reward.mean,
        "reward_ci_low": own.reward.low,
        "reward_ci_high": own.reward.high,
        "errors": float(own.errors),
    }
    if own.success_rate is not None:
        metrics["success_rate"] = own.success_rate
    for k, value in own.pass_at_k.items():
        metrics[f"pass@{k}"] = value
    for pair in result.comparisons:
        if pair.b == own.target and pair.a.startswith("step "):
            metrics["gain"] = pair.diff.mean
            metrics["gain_ci_low"] = pair.diff.low
            metrics["gain_ci_high"] = pair.diff.high
            metrics["improved"] = float(len(pair.changes.improved))
            metrics["worse"] = float(len(pair.changes.worse))
            break
    return {k: v for k, v in metrics.items() if not math.isnan(v)}
