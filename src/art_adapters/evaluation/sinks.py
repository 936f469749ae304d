"""Where an evaluation's result goes besides its JSON file: a page of the local HTML report, W&B metrics, and a
Langfuse dataset run per target (a dataset item per scenario, a trace per attempt scored with its reward)."""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .page import as_message, render_page
from .results import Attempt, EvalResult

REPORT_PAGE = "evaluation.html"


def write_report_section(result: EvalResult, run_dir: str | Path) -> Path:
    """Write the evaluation's page of the local report, `run_dir/evaluation.html` (the model's folder, where
    `report.html` is written; the training report links to it). A later evaluation replaces the page."""
    return write_page(result, Path(run_dir) / REPORT_PAGE)


def write_page(result: EvalResult, path: str | Path) -> Path:
    """Write the evaluation's page at `path`, atomically; it links `report.html` when one is beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    beside = path.parent / "report.html"
    page = render_page(result, report_link="report.html" if beside.exists() else None)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, path)
    return path


# ---- W&B ------------------------------------------------------------------------------------------------------


def metric_label(label: str) -> str:
    """A target's label as one W&B key segment: `step 12` -> `step_12`, `openai/gpt-4o` -> `openai_gpt-4o`."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", label).strip("_") or "target"


def wandb_metrics(result: EvalResult) -> dict[str, float]:
    """The evaluation as flat W&B metrics: `eval/<target>/reward`, `.../reward_ci_low`, `.../reward_ci_high`,
    `.../success_rate`, `.../pass@k`, `.../errors`, `.../scenarios`; `eval/<b>_vs_<a>/diff` (+ its CI bounds,
    improved, same, worse); `eval/held_out`. Non-finite values (a CI over one scenario) are left out."""
    out: dict[str, float] = {"eval/held_out": 1.0 if result.held_out else 0.0}
    for t in result.targets:
        prefix = f"eval/{metric_label(t.target)}"
        values: dict[str, float | None] = {
            "reward": t.reward.mean,
            "reward_ci_low": t.reward.low,
            "reward_ci_high": t.reward.high,
            "success_rate": t.success_rate,
            "errors": float(t.errors),
            "scenarios": float(t.scenarios),
        }
        values |= {f"pass@{k}": v for k, v in sorted(t.pass_at_k.items())}
        out |= {f"{prefix}/{k}": float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
    for c in result.comparisons:
        prefix = f"eval/{metric_label(c.b)}_vs_{metric_label(c.a)}"
        values = {
            "diff": c.diff.mean,
            "diff_ci_low": c.diff.low,
            "diff_ci_high": c.diff.high,
            "improved": float(len(c.changes.improved)),
            "same": float(len(c.changes.same)),
            "worse": float(len(c.changes.worse)),
        }
        out |= {f"{prefix}/{k}": float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
    return out


def log_wandb(result: EvalResult, run: Any, *, step: int | None = None) -> dict[str, float]:
    """Log the evaluation's metrics (wandb_metrics) to a W&B run, or to a WandbLogger's run, at `step` (default:
    the run's current step); returns what was logged. A WandbLogger whose W&B is disabled logs nothing."""
    target = run.run if hasattr(run, "log_step") else run  # a WandbLogger, or a wandb Run
    metrics = wandb_metrics(result)
    if target is None:
        return metrics
    if not callable(getattr(target, "log", None)):
        raise TypeError(f"log_wandb: run must be a wandb Run or a WandbLogger, got {type(run).__name__}")
    if step is None:
        target.log(metrics)
    else:
        target.log(metrics, step=step)
    return metrics


# ---- Langfuse -------------------------------------------------------------------------------------------------


@dataclass
class LangfuseRuns:
    """What log_langfuse wrote: the dataset, and per target its run name, experiment id and trace ids."""

    dataset: str
    item_ids: dict[str, str] = field(default_factory=dict)  # scenario id -> dataset item id
    runs: dict[str, str] = field(default_factory=dict)  # target -> run name
    experiment_ids: dict[str, str] = field(
        default_factory=dict
    )  # target -> Langfuse experiment (dataset run) id
    trace_ids: dict[tuple[str, str, int], str] = field(
        default_factory=dict
    )  # (target, scenario, attempt) -> trace


class _AttemptItem:
    """One attempt presented to langfuse's run_experiment as its dataset item (the SDK reads these attributes)."""

    def __init__(
        self, item_id: str, dataset_id: str, scenario: Any, attempt: Attempt, step: int | None
    ) -> None:
        self.id = item_id
        self.dataset_id = dataset_id
        self.input = scenario
        self.expected_output = None
        self.attempt = attempt
        self.metadata = {
            "scenario_id": attempt.scenario_id,
            "attempt": attempt.attempt,
            "target": attempt.target,
            "step": step,
            "reward": attempt.reward,
            "success": attempt.success,
            "error": attempt.error,
            "seconds": attempt.seconds,
        }


def prompt_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages before the first assistant turn: what the agent was asked."""
    out = []
    for raw in messages:
        message = as_message(raw)
        if message.get("role") == "assistant":
            break
        out.append(message)
    return out


def answer_of(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages from the first assistant turn on: tool calls, tool results and answers."""
    plain = [as_message(m) for m in messages]
    return plain[len(prompt_of(messages)) :]


def dataset_item_id(dataset: str, scenario_id: str) -> str:
    """A stable item id per (dataset, scenario): a rerun updates the same item (Langfuse ids are global)."""
    return hashlib.sha256(f"{dataset}\0{scenario_id}".encode()).hexdigest()[:32]


def log_langfuse(
    result: EvalResult,
    client: Any,
    *,
    scenarios: Mapping[str, Any] | None = None,
    dataset_name: str | None = None,
    targets: Sequence[str] | None = None,
) -> LangfuseRuns | None:
    """Make the evaluation a Langfuse dataset with one run per target, so the targets' answers to one scenario
    sit side by side in Langfuse's experiment compare view.

    The dataset (`dataset_name`, default `<project>/<model>/<split>`) gets an item per scenario; its input is the
    scenario from `scenarios` (id -> scenario), else the first attempt's prompt messages. Each target becomes a run
    (`<model> <target>`, e.g. `agent-001 step 12`) with one trace per attempt: input the scenario, output the
    attempt's messages from the first assistant turn (tool calls included), a `reward` score (and `success` when
    known), the attempt's error as an ERROR level. `client` is a `langfuse.Langfuse` or a LangfuseExporter; a
    disabled exporter (no keys) logs nothing and returns None. Uses the SDK's run_experiment, so Langfuse links
    the runs to the dataset exactly as for its own experiments.

    A run is named after its target, so logging a target again adds its attempts to the same run: during training,
    pass `targets=` (e.g. only the new step) to log each target once."""
    langfuse = client.client if hasattr(client, "export") and hasattr(client, "client") else client
    if langfuse is None:
        return None
    if not callable(getattr(langfuse, "run_experiment", None)):
        raise TypeError(
            f"log_langfuse: client must be a langfuse.Langfuse or a LangfuseExporter, got {type(client).__name__}"
        )
    steps = {t.target: t.step for t in result.targets}
    labels = [t.target for t in result.targets] + sorted({a.target for a in result.attempts} - set(steps))
    if targets is not None:
        unknown = sorted(set(targets) - set(labels))
        if unknown:
            raise ValueError(f"log_langfuse: no target(s) {unknown} in this evaluation (have: {labels})")
        labels = [label for label in labels if label in set(targets)]
    from langfuse import Evaluation

    name = dataset_name or f"{result.project}/{result.model}/{result.split}"
    langfuse.create_dataset(
        name=name,
        description=f"art-adapters evaluation scenarios of {result.project}/{result.model} ({result.split} split)",
        metadata={"project": result.project, "model": result.model, "split": result.split},
    )
    runs = LangfuseRuns(dataset=name)
    prompts: dict[str, list[dict[str, Any]]] = {}
    for a in result.attempts:  # the first attempt with messages tells what the scenario asked
        if not prompts.get(a.scenario_id):
            prompts[a.scenario_id] = prompt_of(a.messages)
    inputs: dict[str, Any] = {}
    for scenario_id, prompt in prompts.items():
        if scenarios is not None and scenario_id in scenarios:
            inputs[scenario_id] = scenarios[scenario_id]
        else:
            inputs[scenario_id] = prompt or {"scenario_id": scenario_id}
    dataset_id = ""
    for scenario_id, scenario in inputs.items():
        item = langfuse.create_dataset_item(
            dataset_name=name,
            id=dataset_item_id(name, scenario_id),
            input=scenario,
            metadata={"scenario_id": scenario_id},
        )
        runs.item_ids[scenario_id] = item.id
        dataset_id = item.dataset_id

    def task(*, item: _AttemptItem, **_: Any) -> Any:
        attempt = item.attempt
        if attempt.error is not None:
            langfuse.update_current_span(level="ERROR", status_message=attempt.error)
            return {"error": attempt.error, "messages": answer_of(attempt.messages)}
        return answer_of(attempt.messages)

    def reward(*, metadata: dict[str, Any] | None = None, **_: Any) -> list[Any]:
        metadata = metadata or {}
        out = []
        if metadata.get("reward") is not None:
            out.append(Evaluation(name="reward", value=float(metadata["reward"]), data_type="NUMERIC"))
        if metadata.get("success") is not None:
            out.append(Evaluation(name="success", value=bool(metadata["success"]), data_type="BOOLEAN"))
        return out

    for label in labels:
        data = [
            _AttemptItem(
                runs.item_ids[a.scenario_id],
                dataset_id,
                inputs[a.scenario_id],
                a,
                steps.get(label),
            )
            for a in result.attempts
            if a.target == label
        ]
        if not data:
            continue
        run_name = f"{result.model} {label}"
        outcome = langfuse.run_experiment(
            name=f"{result.model} evaluation",
            run_name=run_name,
            description=f"{label} on {len({d.attempt.scenario_id for d in data})} scenario(s), "
            f"{result.attempts_per_scenario} attempt(s) each",
            data=data,
            task=task,
            evaluators=[reward],
            metadata={"target": label, "model": result.model, "split": result.split},
        )
        runs.runs[label] = run_name
        runs.experiment_ids[label] = outcome.experiment_id
        for item_result in outcome.item_results:
            a = item_result.item.attempt
            runs.trace_ids[(a.target, a.scenario_id, a.attempt)] = item_result.trace_id
    return runs
