"""Writes the docs' framework matrix from the last matrix run (`build/matrix.json`, written by tests/test_matrix.py).

python tests/matrix/table.py    # rewrites the tables between the markers of docs/frameworks/index.md (the matrix)
                                # and docs/multi-agent.md (the frameworks proven routed per agent)
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
MARKERS = {"matrix": ("<!-- matrix:start -->", "<!-- matrix:end -->")}
MARKERS["agents"] = ("<!-- matrix-agents:start -->", "<!-- matrix-agents:end -->")
sys.path.insert(0, str(Path(__file__).parent))

from envs import FRAMEWORKS  # noqa: E402


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| framework | versions | capture | streamed | calls / rollout | sources seen | sequences / rollout"
        " (why more than one) | trained = sampled | per-agent adapters |",
        "|---|---|---|---|---:|---|---|---:|---|",
    ]
    for name in FRAMEWORKS:
        row = rows.get(name)
        if row is None or "versions" not in row:  # not run (or only its per-agent run)
            module = importlib.import_module(f"frameworks.{name}")
            lines.append(f"| {module.NAME} | – | not run | | | | | | |")
            continue
        versions = ", ".join(f"{k} {v}" for k, v in row["versions"].items())
        sources = " → ".join(row["sources"]) if any(s != "-" for s in row["sources"]) else "framework only"
        why = row.get("why") or ", ".join(f"{n}× {cause}" for cause, n in row["breaks"].items())
        sequences = f"{row['sequences']}" + (f" ({why})" if why else "")
        fraction = f"{row['trained_fraction']:.0%}"
        lines.append(
            f"| {row['name']} | {versions} | {row['route']} | {row['streamed']} | {row['calls']} | {sources} "
            f"| {sequences} | {fraction} | {per_agent_cell(name, row)} |"
        )
    return "\n".join(lines)


def per_agent_cell(name: str, row: dict) -> str:
    """The matrix's per-agent column: routed by what, or why not."""
    module = importlib.import_module(f"frameworks.{name}")
    if not hasattr(module, "PER_AGENT"):
        return "– (no agent or node reported)"
    run = row.get("per_agent")
    if run is None:
        return "not run"
    return f"routed by {run['by']}: " + ", ".join(n for n in run["adapters"] if n != "shared")


def agents_table(rows: dict[str, dict]) -> str:
    """docs/multi-agent.md's table: each framework of the matrix that reports agents or nodes, run per agent."""
    lines = [
        "| framework | `by` | agents' adapters (calls / rollout, tokens trained by the step) | shared adapter"
        " (the same) |",
        "|---|---|---|---|",
    ]
    for name in FRAMEWORKS:
        module = importlib.import_module(f"frameworks.{name}")
        if not hasattr(module, "PER_AGENT"):
            continue
        run = rows.get(name, {}).get("per_agent")
        if run is None:
            lines.append(f"| {module.NAME} | `{module.PER_AGENT[0]}` | not run | |")
            continue
        adapters = run["adapters"]
        routed = ", ".join(
            f"`{n}` ({a['calls']}, {a['trained_tokens']})" for n, a in adapters.items() if n != "shared"
        )
        shared = adapters.get("shared")
        sources = ", ".join(run["shared_sources"])
        kept = f"{shared['calls']}, {shared['trained_tokens']} (calls from {sources})" if shared else "none"
        lines.append(f"| {module.NAME} | `{run['by']}` | {routed} | {kept} |")
    return "\n".join(lines)


def write_between(page: Path, markers: tuple[str, str], text: str) -> None:
    start, end = markers
    head, rest = page.read_text().split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def main() -> None:
    rows = json.loads((ROOT / "build" / "matrix.json").read_text())
    write_between(ROOT / "docs" / "frameworks" / "index.md", MARKERS["matrix"], table(rows))
    write_between(ROOT / "docs" / "multi-agent.md", MARKERS["agents"], agents_table(rows))
    routed = sum("per_agent" in row for row in rows.values())
    print(f"docs: {len(rows)} of {len(FRAMEWORKS)} frameworks, {routed} run per agent")


if __name__ == "__main__":
    main()
