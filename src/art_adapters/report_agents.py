"""The report's per-agent view (`art.PerAgent`): each agent's step metrics (`agent/{name}/...` rows of history.jsonl)
and, from the saved trajectories, which adapter and which of its versions served each agent's calls."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping

from .agent_adapters import AGENT_METRICS, SHARED, served_adapter
from .trajectories import LLMCall, Trajectory

SHARED_LABEL = "shared"  # the shared adapter's name in the metrics and in this view


def call_adapter(call: LLMCall, model_key: str | None) -> str | None:
    """The adapter that served `call` ("shared" for the model's own), from its `served_model`; None when the call
    was not served by the model (`model_key`, `{project}/{name}`) or says nothing."""
    found = served_adapter(call.served_model, model_key)
    if found is None:
        return None
    return SHARED_LABEL if found[0] == SHARED else found[0]


def agent_metrics(history: list[dict[str, float]]) -> list[tuple[int, str, dict[str, float]]]:
    """(step, agent, {metric: value}) for every `agent/{name}/{metric}` a history row holds, by step then agent."""
    rows: list[tuple[int, str, dict[str, float]]] = []
    for row in history:
        agents: dict[str, dict[str, float]] = {}
        for key, value in row.items():
            prefix, _, rest = key.partition("/")
            name, _, metric = rest.rpartition("/")
            if prefix == "agent" and name and metric in AGENT_METRICS:
                agents.setdefault(name, {})[metric] = value
        rows += [(int(row["step"]), name, agents[name]) for name in sorted(agents)]
    return rows


def served_calls(
    trajectories: Mapping[str, Mapping[int, list[Trajectory]]], model_key: str | None
) -> list[tuple[str, int, str, list[int], int]]:
    """(split, step, adapter, versions that served, calls) over the saved trajectories' calls."""
    seen: dict[tuple[str, int, str], tuple[set[int], int]] = {}
    for split, steps in trajectories.items():
        for step, items in steps.items():
            for trajectory in items:
                for call in trajectory.llm_calls:
                    adapter = call_adapter(call, model_key)
                    if adapter is None:
                        continue
                    versions, count = seen.get((split, step, adapter), (set(), 0))
                    if call.policy_version is not None:
                        versions.add(call.policy_version)
                    seen[(split, step, adapter)] = (versions, count + 1)
    return [(sp, st, ad, sorted(v), n) for (sp, st, ad), (v, n) in sorted(seen.items())]


def _cell(value: float | None) -> str:
    if value is None:
        return ""
    if not math.isfinite(value):
        return str(value)
    return str(int(value)) if value == int(value) and abs(value) < 1e15 else f"{value:.4g}"


def agents_html(
    history: list[dict[str, float]],
    trajectories: Mapping[str, Mapping[int, list[Trajectory]]],
    model_key: str | None,
) -> str:
    """The `#agents` section: per-agent step metrics and the adapters that served each step's calls; "" for a run
    without per-agent adapters (no agent metrics, no call served by an agent's adapter)."""
    metrics = agent_metrics(history)
    calls = served_calls(trajectories, model_key)
    if not metrics and all(adapter == SHARED_LABEL for _, _, adapter, _, _ in calls):
        return ""
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ("step", "agent", *AGENT_METRICS))
    body = "".join(
        f'<tr data-agent="{html.escape(name)}"><td>{step}</td><td>{html.escape(name)}</td>'
        + "".join(f"<td>{_cell(values.get(k))}</td>" for k in AGENT_METRICS)
        + "</tr>"
        for step, name, values in metrics
    )
    served_head = "".join(f"<th>{k}</th>" for k in ("split", "step", "adapter", "versions", "calls"))
    served_body = "".join(
        f'<tr data-adapter="{html.escape(adapter)}"><td>{html.escape(split)}</td><td>{step}</td>'
        f"<td>{html.escape(adapter)}</td><td>{', '.join(map(str, versions))}</td><td>{n}</td></tr>"
        for split, step, adapter, versions, n in calls
    )
    return (
        '<section id="agents"><h2>Per agent</h2>'
        "<h3>Step metrics per agent's adapter</h3>"
        f'<div class="scroll"><table id="agent-steps"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        "<h3>Which adapter served the saved calls</h3>"
        f'<div class="scroll"><table id="agent-calls"><thead><tr>{served_head}</tr></thead>'
        f"<tbody>{served_body}</tbody></table></div></section>"
    )
