"""The printed summary of an evaluation: one row per target (reward with its CI, success, pass@k, errors) and one
per comparison (the paired gain with its CI, scenarios improved / same / worse), as a markdown-style table."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .intervals import Interval
from .results import EvalResult

MAX_PASS_COLUMNS = 6  # beyond this many k values, show k = 1, 2, 4, 8, ... and the largest k


def shown_ks(ks: Sequence[int], limit: int = MAX_PASS_COLUMNS) -> list[int]:
    """The k values given a column: all of them up to `limit`, else 1, the powers of two and the largest."""
    ordered = sorted(set(ks))
    if len(ordered) <= limit:
        return ordered
    largest = ordered[-1]
    return [k for k in ordered if k & (k - 1) == 0 or k == largest]


def format_interval(interval: Interval, *, signed: bool = False, digits: int = 3) -> str:
    """`0.412 [0.331, 0.497]`; bounds as n/a when there were too few scenarios to say."""
    sign = "+" if signed else ""

    def number(value: float) -> str:
        return f"{value:{sign}.{digits}f}" if math.isfinite(value) else "n/a"

    if math.isfinite(interval.low) and math.isfinite(interval.high):
        return f"{number(interval.mean)} [{number(interval.low)}, {number(interval.high)}]"
    return f"{number(interval.mean)} [n/a]"


def _render(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths))
        + "|"
    )
    return [line(header), rule, *(line(r) for r in rows)]


def format_table(result: EvalResult) -> str:
    """The evaluation as text: a title line, the not-held-out warning when it applies, the per-target table and
    the comparisons table."""
    sampling = ", ".join(f"{k}={v}" for k, v in result.sampling.items() if v is not None)
    lines = [
        f"Evaluation of {result.model} (project {result.project}, split {result.split}): "
        f"{result.attempts_per_scenario} attempt(s) per scenario"
        + (f"; sampling {sampling}" if sampling else "")
    ]
    if not result.held_out:
        ids = result.not_held_out_ids
        shown = ", ".join(ids[:10]) + (f", ... ({len(ids)} in all)" if len(ids) > 10 else "")
        lines.append(
            f"WARNING: not held out: {len(ids)} evaluated scenario(s) were used in training"
            + (f" ({shown})" if ids else "")
        )
    ks = shown_ks([k for t in result.targets for k in t.pass_at_k])
    header = ["target", "scenarios", "errors", "reward [95% CI]", "success", *(f"pass@{k}" for k in ks)]
    rows = []
    for target in result.targets:
        rows.append(
            [
                target.target,
                str(target.scenarios),
                str(target.errors),
                format_interval(target.reward),
                "n/a" if target.success_rate is None else f"{100 * target.success_rate:.1f}%",
                *(f"{target.pass_at_k[k]:.3f}" if k in target.pass_at_k else "n/a" for k in ks),
            ]
        )
    lines.append("")
    lines += _render(header, rows, right={1, 2, 4, *range(5, 5 + len(ks))}) if rows else ["(no targets)"]
    if result.comparisons:
        header = ["comparison", "diff [95% CI]", "improved", "same", "worse"]
        rows = [
            [
                f"{c.b} vs {c.a}",
                format_interval(c.diff, signed=True),
                str(len(c.changes.improved)),
                str(len(c.changes.same)),
                str(len(c.changes.worse)),
            ]
            for c in result.comparisons
        ]
        lines.append("")
        lines += _render(header, rows, right={2, 3, 4})
        for c in result.comparisons:
            if c.unpaired:
                shown = ", ".join(c.unpaired[:10]) + (", ..." if len(c.unpaired) > 10 else "")
                lines.append(
                    f"{c.b} vs {c.a}: {len(c.unpaired)} scenario(s) not compared (every attempt of one side "
                    f"errored): {shown}"
                )
    return "\n".join(lines)
