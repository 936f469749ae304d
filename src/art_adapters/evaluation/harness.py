"""`art.evaluate`: the user's own rollout, unchanged, over scenarios x attempts x targets (steps of the trained model
served as versions on its engine, and reference models), with evaluation sampling applied to every request it
sends, finished attempts kept on disk for `resume`, and the statistics of summarize.py."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..capture.overrides import RequestOverride, request_override
from ..model import Model, TrainableModel
from ..trajectories import Trajectory, TrajectoryGroup, reward_missing
from ..untrusted import check_name
from .results import Attempt, EvalResult, plain_messages
from .resume import AttemptKey, AttemptLog
from .scenarios import check_train_ids, load_scenarios, with_ids
from .summarize import comparison, default_pairs, mark_success, summarize_target
from .targets import Reference, StepSpec, Target, check_steps, reference_target, step_targets, target_view
from .threads import in_daemon_thread

Rollout = Callable[[Model, Any], Awaitable[Trajectory] | Trajectory]


class EvaluationError(RuntimeError):
    """Too many attempts failed (the first failure is the cause), or a rollout is unusable."""


@dataclass(frozen=True)
class Sampling:
    """Sampling for evaluation, separate from training: set on every request the rollout sends (None: left as the
    rollout sets it). `temperature=0` is ART's `eval_temperature=0`. `seed`: call i of attempt a of scenario s gets
    a seed derived from (seed, s, a, i), the same on every target, so each step sees the same draws where the
    engine honours seeds; None leaves seeds alone."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = 0

    def __post_init__(self) -> None:
        t, p, m, s = self.temperature, self.top_p, self.max_tokens, self.seed
        if t is not None and not (_number(t) and math.isfinite(t) and t >= 0):
            raise ValueError(f"sampling temperature must be a number >= 0, not {t!r}")
        if p is not None and not (_number(p) and 0 < p <= 1):
            raise ValueError(f"sampling top_p must be in (0, 1], not {p!r}")
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"sampling max_tokens must be an int >= 1, not {m!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"sampling seed must be an int or None, not {s!r}")

    @classmethod
    def of(cls, value: Sampling | dict[str, Any] | None) -> Sampling:
        if value is None or isinstance(value, Sampling):
            return value or cls()
        if not isinstance(value, dict):
            raise TypeError(f"sampling must be a Sampling or a dict, not {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown sampling settings {unknown} (known: {sorted(cls.__dataclass_fields__)})"
            )
        return cls(**value)

    def overrides(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}


async def evaluate(
    model: Model,
    rollout: Rollout,
    scenarios: Iterable[Any] | str | Path,
    *,
    attempts: int = 1,
    steps: Sequence[StepSpec] = (0, "latest"),
    split: str = "val",
    sampling: Sampling | dict[str, Any] | None = None,
    references: Sequence[Reference | dict[str, Any]] = (),
    train_ids: Iterable[Any] | None = None,
    success_threshold: float | None = None,
    max_error_fraction: float = 0.1,
    pass_k: Sequence[int] | None = None,
    comparisons: Sequence[tuple[str, str]] | None = None,
    max_concurrent: int = 32,
    attempt_timeout_s: float | None = 600.0,
    resume: str | Path | None = None,
    output: str | Path | None = None,
    progress: bool = True,
    report: bool = True,
    wandb: Any = None,
    langfuse: Any = None,
) -> EvalResult:
    """Run `rollout(model_view, scenario)` — the same rollout used for training, unchanged — `attempts` times per
    scenario against each target, and say whether training helped (docs/evaluation.md).

    Targets: each of `steps` (0: before training; "latest": the newest checkpoint; any checkpointed step number),
    served on the model's engine, then each `references` model. The rollout gets a copy of `model` whose
    `get_inference_name()`, endpoint and `openai_client()` reach the target; requests naming the model itself are
    sent to the target too. `scenarios`: dicts with "id" or objects with `.id`, or a .jsonl/.json file of them.
    `sampling` applies to every request sent through art-adapters' client (`model.openai_client()`, a decorated
    rollout, `init_chat_model`). `train_ids`: the training scenarios' ids; any evaluated one warns and marks the
    result not held out. `success_threshold`: reward >= it is a success (without it, 0/1 rewards are booleans).
    `pass_k`: the k of pass@k (default every k <= attempts). `comparisons`: (a, b) target labels, diff = b - a
    (default: every later step against the first, the newest step against each reference). An attempt still
    running after `attempt_timeout_s` is cancelled and counted as an error (None: no bound). More than
    `max_error_fraction` of attempts failing raises EvaluationError from the first failure. `resume`: a JSONL file
    each finished attempt is appended to; a rerun skips those. `output`: the result as JSON. `split`: the name the
    result is recorded under. Then the result is published (publish.py): `report` writes the page evaluation.html
    into the model's folder (LocalBackend), else beside `output` as its .html, else nowhere; `wandb` (a
    WandbLogger or wandb Run) gets its metrics, `langfuse` (a LangfuseExporter or langfuse.Langfuse) a dataset run
    per target. A sink that fails warns, naming itself; the result is still returned and its JSON written."""
    from .publish import Publisher, check_sinks, report_page_path

    check_sinks(wandb, langfuse)
    settings = Sampling.of(sampling)
    check_name("split", split)  # it names metrics and files
    items = with_ids(load_scenarios(scenarios) if isinstance(scenarios, str | Path) else scenarios)
    ids = [sid for sid, _ in items]
    ks = check_counts(attempts, pass_k, max_error_fraction, max_concurrent)
    check_limits(attempt_timeout_s, success_threshold)
    step_specs = check_steps(list(steps))
    if step_specs and getattr(model, "adapters", None) is not None:
        raise ValueError(
            f"model {model.name!r} has per-agent adapters (adapters=PerAgent(...)): evaluating its steps would "
            "answer every agent with the shared adapter; per-agent evaluation is not built yet (pass steps=[] "
            "and references, or evaluate a model without PerAgent)"
        )
    if step_specs and not isinstance(model, TrainableModel):
        raise ValueError(
            f"model {model.name!r} is not trainable: it has no steps; pass steps=[] and references"
        )
    references = [Reference(**r) if isinstance(r, dict) else r for r in references]
    labels = [r.name for r in references]
    if len(set(labels)) != len(labels) or any(label.startswith("step ") for label in labels):
        raise ValueError(f"reference labels must be distinct and not start with 'step ': {labels}")
    refs = [reference_target(r) for r in references]
    if not step_specs and not refs:
        raise ValueError("nothing to evaluate: give steps, references, or both")
    held_out_ids = _not_held_out(ids, train_ids)
    targets = (await step_targets(model, step_specs)) if step_specs else []  # type: ignore[arg-type]
    targets = sorted(targets, key=lambda t: t.step or 0) + refs
    target_labels = [t.label for t in targets]
    step_labels = [t.label for t in targets if t.step is not None]
    pairs = list(comparisons) if comparisons is not None else default_pairs(step_labels, labels)
    for a, b in pairs:
        for label in (a, b):
            if label not in target_labels:
                raise ValueError(f"comparison names unknown target {label!r} (targets: {target_labels})")

    fingerprint = {
        "model": model.name,
        "project": model.project,
        "targets": [[t.label, t.model_name] for t in targets],  # not the URL: a restarted engine moves port
        "scenarios": ids,
        "attempts": attempts,
        "sampling": asdict(settings),
    }
    log = AttemptLog(resume, fingerprint) if resume is not None else None
    total = attempts * len(items) * len(targets)
    run = _Run(model, rollout, targets, settings, sampling is not None, log, max_error_fraction, total)
    run.timeout_s = attempt_timeout_s
    try:
        # an errored attempt (an endpoint that was down, a timeout) is run again: only finished ones are skipped
        done = {k: a for k, a in (log.open() if log is not None else {}).items() if a.error is None}
        run.results.update(done)
        todo = [
            (target, sid, scenario, a)
            for sid, scenario in items
            for a in range(attempts)
            for target in targets
            if (target.label, sid, a) not in done
        ]
        await run.all(todo, max_concurrent, progress, initial=len(done))
    finally:
        await run.close()
        if log is not None:
            log.close()

    finished = [run.results[(t.label, sid, a)] for t in targets for sid in ids for a in range(attempts)]
    known = mark_success(finished, success_threshold)
    summaries = [summarize_target(finished, t.label, t.step, ids, ks, known) for t in targets]
    result = EvalResult(
        model=model.name,
        project=model.project,
        split=split,
        attempts_per_scenario=attempts,
        sampling=asdict(settings),
        held_out=not held_out_ids,
        not_held_out_ids=held_out_ids,
        targets=summaries,
        comparisons=[comparison(finished, a, b, ids) for a, b in pairs],
        attempts=finished,
    )
    if output is not None:
        write_result(result, output)
    if report or wandb is not None or langfuse is not None:
        publisher = Publisher(report_page_path(model, output) if report else None, wandb, langfuse)
        await asyncio.to_thread(publisher.publish, result, scenarios=dict(items))
    return result


def write_result(result: EvalResult, path: str | Path) -> Path:
    """The result as JSON at `path`, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def check_counts(
    attempts: int, pass_k: Sequence[int] | None, max_error_fraction: float, max_concurrent: int
) -> list[int]:
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, not {attempts!r}")
    ks = list(range(1, attempts + 1)) if pass_k is None else list(pass_k)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= attempts:
            raise ValueError(f"pass@k needs 1 <= k <= attempts ({attempts}); got k={k!r}")
    if not (_number(max_error_fraction) and 0 <= max_error_fraction <= 1):
        raise ValueError(f"max_error_fraction must be in [0, 1], not {max_error_fraction!r}")
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f"max_concurrent must be an int >= 1, not {max_concurrent!r}")
    return sorted(set(ks))


def check_limits(attempt_timeout_s: float | None, success_threshold: float | None) -> None:
    """The attempt timeout (a number > 0, or None) and the success threshold (finite, or None), checked."""
    if attempt_timeout_s is not None and not (
        _number(attempt_timeout_s) and math.isfinite(attempt_timeout_s) and attempt_timeout_s > 0
    ):
        raise ValueError(f"attempt_timeout_s must be a number > 0 or None, not {attempt_timeout_s!r}")
    if success_threshold is not None and not (
        _number(success_threshold) and math.isfinite(success_threshold)
    ):
        raise ValueError(f"success_threshold must be a finite number, not {success_threshold!r}")


def _not_held_out(ids: list[str], train_ids: Iterable[Any] | None) -> list[str]:
    """The evaluated ids that were trained on (warned about once)."""
    checked = check_train_ids(train_ids)
    if checked is None:
        return []
    trained = set(checked)
    overlap = [sid for sid in ids if sid in trained]
    if overlap:
        shown = ", ".join(overlap[:5]) + (f" and {len(overlap) - 5} more" if len(overlap) > 5 else "")
        warnings.warn(
            f"{len(overlap)} of {len(ids)} evaluation scenarios were used in training ({shown}): this result is "
            "not held out (result.held_out is False)",
            UserWarning,
            stacklevel=3,
        )
    return overlap


def _number(value: Any) -> bool:
    """An int or float, not a bool (True is not a temperature)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # an exception whose __str__ raises is still counted, not fatal
        text = "(its message could not be printed)"
    return f"{type(error).__name__}: {text}"


class _Run:
    """The attempts of one evaluation in flight: views per target, the error budget, the attempts file."""

    def __init__(
        self,
        model: Model,
        rollout: Rollout,
        targets: list[Target],
        sampling: Sampling,
        sampling_given: bool,
        log: AttemptLog | None,
        max_error_fraction: float,
        total: int,
    ) -> None:
        self.rollout, self.sampling, self.sampling_given, self.log = rollout, sampling, sampling_given, log
        self.views = {t.label: target_view(model, t) for t in targets}
        own = (
            {model.name, model.get_inference_name()}
            if model.inference_model_name or model.trainable
            else set()
        )
        self.own = own
        self.names = {
            t.label: ({n: t.model_name for n in own} if t.step is not None else {}) for t in targets
        }
        self.results: dict[AttemptKey, Attempt] = {}
        self.allowed = max_error_fraction * total
        self.errors = sum(1 for a in self.results.values() if a.error is not None)
        self.first_error: BaseException | None = None
        self.warned_bypass = False
        self.timeout_s: float | None = None

    async def all(
        self, todo: list[tuple[Target, str, Any, int]], limit: int, progress: bool, initial: int
    ) -> None:
        self.errors = sum(1 for a in self.results.values() if a.error is not None)
        self._check_budget()
        bar = None
        if progress and todo:
            from ..progress import progress_bar

            bar = progress_bar(initial + len(todo), "evaluate", "attempt", initial=initial)
        gate = asyncio.Semaphore(limit)

        async def one(item: tuple[Target, str, Any, int]) -> None:
            async with gate:
                attempt = await self.attempt(*item)
            self.results[(attempt.target, attempt.scenario_id, attempt.attempt)] = attempt
            if self.log is not None:
                await asyncio.to_thread(self.log.add, attempt)
            if bar is not None:
                bar.update(1)
            if attempt.error is not None:
                self.errors += 1
                self._check_budget()

        try:
            async with asyncio.TaskGroup() as group:
                for item in todo:
                    group.create_task(one(item))
        except* (EvaluationError, TypeError) as failed:
            error = failed.exceptions[0]
            raise error from error.__cause__  # its own cause (the first failure) stays
        finally:
            if bar is not None:
                bar.close()

    def _check_budget(self) -> None:
        if self.errors > self.allowed:
            first = (
                _describe(self.first_error)
                if self.first_error is not None
                else next((a.error for a in self.results.values() if a.error is not None), None)
            )
            raise EvaluationError(
                f"{self.errors} attempts failed, more than max_error_fraction allows ({self.allowed:g}); "
                f"the first: {first}"
            ) from self.first_error

    async def attempt(self, target: Target, sid: str, scenario: Any, index: int) -> Attempt:
        seed = None if self.sampling.seed is None else (self.sampling.seed, sid, index)
        override = RequestOverride(self.sampling.overrides(), seed, self.names[target.label])
        if target.step is None:  # the model's own names reach its engine, not this reference
            why = (
                f"the rollout's request names the model itself ({{}}) on its own client, so it cannot be sent to "
                f"reference {target.label!r} (it would be answered by the trained model): use model.openai_client() "
                "and model.get_inference_name() to evaluate a reference"
            )
            override.stranded = {name: why.format(name) for name in self.own}
            override.target_url = target.base_url
            override.unseeded = frozenset({"messages", "responses"})  # OpenAI's Responses API has no seed
        start = time.monotonic()
        error: BaseException | None = None
        trajectory: Trajectory | None = None
        with request_override(override):
            deadline = asyncio.timeout(self.timeout_s)
            try:
                async with deadline:
                    trajectory = await self._call(self.views[target.label], scenario)
            except TimeoutError as late:
                expired = deadline.expired()
                error = TimeoutError(f"the attempt ran longer than {self.timeout_s:g} s") if expired else late
            except TypeError as wrong:
                if getattr(wrong, "unusable_rollout", False):
                    raise
                error = wrong
            except Exception as failed:
                error = failed
        if override.refused is not None:  # the client may have wrapped it (openai: "Connection error.")
            error = RuntimeError(override.refused)
        if error is None and override.calls == 0:
            error = self._bypassed()
        reward = None if trajectory is None else trajectory.reward
        if error is None and not (isinstance(reward, int | float) and math.isfinite(reward)):  # a bool is 0/1
            error = ValueError(f"the rollout's reward is {reward!r}, not a finite number")
        if error is None and reward_missing(trajectory):  # type: ignore[arg-type]
            error = ValueError(
                "the rollout's trajectory has no reward (flagged reward_missing; 0.0 is a placeholder)"
            )
        if error is not None and self.first_error is None:
            self.first_error = error
        return Attempt(
            target=target.label,
            scenario_id=sid,
            attempt=index,
            reward=None if error is not None else float(reward),  # type: ignore[arg-type]
            success=None,
            error=None if error is None else _describe(error),
            messages=plain_messages(trajectory) if trajectory is not None else [],
            seconds=time.monotonic() - start,
        )

    def _bypassed(self) -> Exception | None:
        message = (
            "the rollout sent no request through art-adapters' client, so evaluation sampling could not be applied "
            "(use model.openai_client(), a decorated rollout or init_chat_model)"
        )
        if self.sampling_given:
            return RuntimeError(message)
        if not self.warned_bypass:
            self.warned_bypass = True
            warnings.warn(message + ": per-attempt seeds are not fixed", UserWarning, stacklevel=2)
        return None

    async def _call(self, view: Model, scenario: Any) -> Trajectory:
        if inspect.iscoroutinefunction(self.rollout):
            result = await self.rollout(view, scenario)  # type: ignore[misc]
        else:
            result = await in_daemon_thread(self.rollout, view, scenario)
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, TrajectoryGroup) and len(result.trajectories) == 1 and not result.exceptions:
            result = result.trajectories[0]
        if not isinstance(result, Trajectory):
            what = (
                f"a TrajectoryGroup of {len(result.trajectories)}"
                if isinstance(result, TrajectoryGroup)
                else type(result).__name__
            )
            wrong = TypeError(
                f"the rollout returned {what}, not a Trajectory: evaluate() runs `rollout(model, scenario)` once per "
                "attempt and needs one Trajectory with its reward (attempts= gives the repetitions)"
            )
            wrong.unusable_rollout = True  # type: ignore[attr-defined]
            raise wrong
        return result

    async def close(self) -> None:
        for view in self.views.values():
            client = view.__pydantic_private__.get("_client") if view.__pydantic_private__ else None
            if client is not None:
                await client.close()
