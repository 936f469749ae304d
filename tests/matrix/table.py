"""Writes the docs' framework matrix from the last matrix run (`build/matrix.json`, written by tests/test_matrix.py).

python tests/matrix/table.py            # rewrites the table between the matrix markers of docs/frameworks/index.md
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
sys.path.insert(0, str(Path(__file__).parent))

from envs import FRAMEWORKS  # noqa: E402


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| framework | versions | capture | streamed | calls / rollout | sources seen | sequences / rollout"
        " (why more than one) | trained = sampled |",
        "|---|---|---|---|---:|---|---|---:|",
    ]
    for name in FRAMEWORKS:
        row = rows.get(name)
        if row is None:
            module = importlib.import_module(f"frameworks.{name}")
            lines.append(f"| {module.NAME} | – | not run | | | | | |")
            continue
        versions = ", ".join(f"{k} {v}" for k, v in row["versions"].items())
        sources = " → ".join(row["sources"]) if any(s != "-" for s in row["sources"]) else "framework only"
        why = row.get("why") or ", ".join(f"{n}× {cause}" for cause, n in row["breaks"].items())
        sequences = f"{row['sequences']}" + (f" ({why})" if why else "")
        fraction = f"{row['trained_fraction']:.0%}"
        lines.append(
            f"| {row['name']} | {versions} | {row['route']} | {row['streamed']} | {row['calls']} | {sources} "
            f"| {sequences} | {fraction} |"
        )
    return "\n".join(lines)


def main() -> None:
    rows = json.loads((ROOT / "build" / "matrix.json").read_text())
    page = ROOT / "docs" / "frameworks" / "index.md"
    text = page.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{table(rows)}\n{END}{tail}")
    print(f"{page.relative_to(ROOT)}: {len(rows)} of {len(FRAMEWORKS)} frameworks")


if __name__ == "__main__":
    main()
