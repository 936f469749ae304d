"""The evaluation's page of the local HTML report: reward per step with its CI band and pass@k curves (inline SVG),
the summary tables, and every scenario's attempts with their messages, tool calls and rewards. Self-contained and
static: no script, every text from a scenario or a model escaped."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from .._report_assets import CSS
from ..report import COLORS
from .results import Attempt, EvalResult
from .table import format_interval

MAX_TEXT = 4000  # characters of one message's content or tool arguments shown
W, H, LEFT, RIGHT, TOP, BOTTOM = 420, 240, 56, 110, 26, 32

PAGE_CSS = """
.warn { background: #fef3c7; border: 1px solid #d97706; color: #92400e; padding: 8px 12px; border-radius: 6px; }
.chart .ref { stroke-dasharray: 5 4; stroke-width: 1.5; } .chart .legend-text { font-size: 11px; }
details.scenario { border-top: 1px solid #eef0f3; padding: 4px 0; } details.scenario summary { cursor: pointer; }
.attempt { margin: 6px 0 10px 16px; } .attempt h4 { margin: 6px 0 2px; font-size: 13px; }
.error { color: #b91c1c; font-family: ui-monospace, monospace; white-space: pre-wrap; }
td.improved { color: #15803d; font-weight: 600; } td.worse { color: #b91c1c; font-weight: 600; }
td.id, th.id { text-align: left; }
"""


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _scale(lo: float, hi: float) -> tuple[float, float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0, 1.0
    if hi - lo < 1e-9:
        return lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def _frame(
    title: str, metric: str, x_label: str, xs: list[float], lo: float, hi: float
) -> tuple[list[str], Any, Any]:
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def sy(y: float) -> float:
        return TOP + (hi - y) / (hi - lo) * (H - TOP - BOTTOM)

    parts = [
        f'<svg class="chart" data-metric="{_esc(metric)}" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
        f'<text class="title" x="{LEFT}" y="16">{_esc(title)}</text>',
    ]
    for frac in (0.0, 0.5, 1.0):
        y = lo + frac * (hi - lo)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(y):.1f}" y2="{sy(y):.1f}"/>')
        parts.append(f'<text x="{LEFT - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    ticks = sorted(set(xs))
    every = max(1, math.ceil(len(ticks) / 8))  # at most ~8 labels on the x axis
    for x in ticks[::every] + ([ticks[-1]] if (len(ticks) - 1) % every else []):
        parts.append(f'<text x="{sx(x):.1f}" y="{H - 14}" text-anchor="middle">{x:g}</text>')
    parts.append(
        f'<text x="{(LEFT + W - RIGHT) / 2:.1f}" y="{H - 2}" text-anchor="middle">{_esc(x_label)}</text>'
    )
    return parts, sx, sy


def reward_chart(result: EvalResult) -> str:
    """Mean reward per step with its 95 % CI band; reference targets as dashed horizontal lines."""
    drawn = [
        t for t in result.targets if math.isfinite(t.reward.mean)
    ]  # a target with no finished scenario: none
    steps = sorted((t for t in drawn if t.step is not None), key=lambda t: t.step or 0)
    refs = [t for t in drawn if t.step is None]
    if not steps and not refs:
        return "<p>No targets.</p>"
    values = [
        v for t in result.targets for v in (t.reward.mean, t.reward.low, t.reward.high) if math.isfinite(v)
    ]
    lo, hi = _scale(min(values, default=0.0), max(values, default=1.0))
    xs = [float(t.step or 0) for t in steps] or [0.0]
    parts, sx, sy = _frame("reward per step (95% CI)", "reward", "step", xs, lo, hi)
    color = COLORS[0]
    finite = [t for t in steps if math.isfinite(t.reward.low) and math.isfinite(t.reward.high)]
    if finite:
        upper = [f"{sx(t.step):.1f},{sy(t.reward.high):.1f}" for t in finite]
        lower = [f"{sx(t.step):.1f},{sy(t.reward.low):.1f}" for t in reversed(finite)]
        parts.append(f'<polygon class="band" fill="{color}" points="{" ".join(upper + lower)}"/>')
    if steps:
        line = " ".join(f"{sx(t.step):.1f},{sy(t.reward.mean):.1f}" for t in steps)
        parts.append(f'<polyline class="line" stroke="{color}" points="{line}"/>')
    for t in steps:
        parts.append(
            f'<circle class="point" data-target="{_esc(t.target)}" data-value="{t.reward.mean!r}" '
            f'cx="{sx(t.step):.1f}" cy="{sy(t.reward.mean):.1f}" r="3.5" fill="{color}">'
            f"<title>{_esc(t.target)}: {_esc(format_interval(t.reward))}</title></circle>"
        )
    for i, t in enumerate(refs):
        ref_color = COLORS[(i + 1) % len(COLORS)]
        y = sy(t.reward.mean)
        parts.append(
            f'<line class="ref" data-target="{_esc(t.target)}" stroke="{ref_color}" x1="{LEFT}" x2="{W - RIGHT}" '
            f'y1="{y:.1f}" y2="{y:.1f}"><title>{_esc(t.target)}: {_esc(format_interval(t.reward))}</title></line>'
        )
        parts.append(
            f'<text class="legend-text" x="{W - RIGHT + 4}" y="{y + 4:.1f}">{_esc(t.target[:18])}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def pass_at_k_chart(result: EvalResult) -> str:
    """pass@k against k, one curve per target whose attempts are here (a training run's page: the baseline, the
    newest step and the references; every step is in the reward chart)."""
    shown = {a.target for a in result.attempts}
    curves = [t for t in result.targets if t.pass_at_k and t.target in shown]
    if not curves:
        return "<p>No pass@k: the rollouts gave no success (a boolean reward or a threshold defines it).</p>"
    ks = sorted({k for t in curves for k in t.pass_at_k})
    values = [v for t in curves for v in t.pass_at_k.values()]
    lo, hi = _scale(min(min(values), 0.0), max(max(values), 1.0))
    parts, sx, sy = _frame("pass@k", "pass@k", "k", [float(k) for k in ks], lo, hi)
    for i, t in enumerate(curves):
        color = COLORS[i % len(COLORS)]
        points = sorted(t.pass_at_k.items())
        line = " ".join(f"{sx(k):.1f},{sy(v):.1f}" for k, v in points)
        parts.append(
            f'<polyline class="line" data-target="{_esc(t.target)}" stroke="{color}" points="{line}"/>'
        )
        for k, v in points:
            parts.append(
                f'<circle class="point" data-target="{_esc(t.target)}" data-k="{k}" data-value="{v!r}" '
                f'cx="{sx(k):.1f}" cy="{sy(v):.1f}" r="3" fill="{color}"><title>{_esc(t.target)} pass@{k}: '
                f"{v:.3f}</title></circle>"
            )
        y = TOP + 14 * i + 6
        parts.append(
            f'<rect x="{W - RIGHT + 6}" y="{y - 8}" width="10" height="10" fill="{color}"/>'
            f'<text class="legend-text" x="{W - RIGHT + 20}" y="{y + 1}">{_esc(t.target[:16])}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def summary_tables(result: EvalResult) -> str:
    ks = sorted({k for t in result.targets for k in t.pass_at_k})
    head = "".join(
        f"<th>{h}</th>"
        for h in ["scenarios", "errors", "reward [95% CI]", "success", *(f"pass@{k}" for k in ks)]
    )
    rows = []
    for t in result.targets:
        success = "n/a" if t.success_rate is None else f"{100 * t.success_rate:.1f}%"
        cells = [str(t.scenarios), str(t.errors), format_interval(t.reward), success]
        cells += [_num(t.pass_at_k.get(k)) for k in ks]
        rows.append(
            f'<tr data-target="{_esc(t.target)}"><td class="id">{_esc(t.target)}</td>'
            + "".join(f"<td>{_esc(c)}</td>" for c in cells)
            + "</tr>"
        )
    out = f'<table id="targets"><thead><tr><th class="id">target</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    if result.comparisons:
        rows = [
            f'<tr><td class="id">{_esc(c.b)} vs {_esc(c.a)}</td><td>{_esc(format_interval(c.diff, signed=True))}</td>'
            f"<td>{len(c.changes.improved)}</td><td>{len(c.changes.same)}</td><td>{len(c.changes.worse)}</td></tr>"
            for c in result.comparisons
        ]
        out += (
            '<h3>Comparisons (paired over scenarios)</h3><table id="comparisons"><thead><tr><th class="id">comparison'
            "</th><th>diff [95% CI]</th><th>improved</th><th>same</th><th>worse</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if content is not None and not isinstance(content, str):
        content = json.dumps(content, default=str)
    text = content or ""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " …"


def as_message(item: Any) -> dict[str, Any]:
    """A message dict from one of messages_and_choices' entries (a message, or a Choice holding one)."""
    if isinstance(item, dict) and "role" not in item and isinstance(item.get("message"), dict):
        return item["message"]
    return item if isinstance(item, dict) else {"role": "?", "content": str(item)}


def messages_html(messages: list[Any]) -> str:
    out = []
    for raw in messages:
        m = as_message(raw)
        role = str(m.get("role") or "?")
        label = role + (f" {m['name']}" if m.get("name") else "")
        body = _esc(_text(m.get("content")))
        for call in m.get("tool_calls") or []:
            function = (call.get("function") or {}) if isinstance(call, dict) else {}
            body += (
                f'<span class="toolcall">→ {_esc(function.get("name"))}({_esc(_text(function.get("arguments")))})'
                "</span>"
            )
        css_role = role if role in ("system", "user", "assistant", "tool") else "other"
        out.append(f'<div class="msg {css_role}"><span class="role">{_esc(label)}</span>{body}</div>')
    return "".join(out)


def _attempt_html(a: Attempt) -> str:
    success = "" if a.success is None else f" · success {'yes' if a.success else 'no'}"
    head = f"{a.target} · attempt {a.attempt} · reward {_num(a.reward)}{success} · {a.seconds:.1f} s"
    error = f'<div class="error">{_esc(a.error)}</div>' if a.error else ""
    return f'<div class="attempt"><h4>{_esc(head)}</h4>{error}{messages_html(a.messages)}</div>'


def scenario_table(result: EvalResult) -> str:
    """One row per scenario: each target's mean reward (and errors), each comparison's verdict; the row opens to
    every attempt's conversation. Targets without attempts here (a training run's earlier steps) are left out."""
    shown = {a.target for a in result.attempts}
    targets = [t.target for t in result.targets if t.target in shown]
    by_scenario: dict[str, list[Attempt]] = {}
    for a in result.attempts:
        by_scenario.setdefault(a.scenario_id, []).append(a)
    verdicts: dict[tuple[int, str], str] = {}
    for i, c in enumerate(result.comparisons):
        for kind in ("improved", "same", "worse"):
            for sid in getattr(c.changes, kind):
                verdicts[(i, sid)] = kind
    head = "".join(f"<th>{_esc(t)}</th>" for t in targets) + "".join(
        f"<th>{_esc(c.b)} vs {_esc(c.a)}</th>" for c in result.comparisons
    )
    rows, details = [], []
    for sid, attempts in by_scenario.items():
        cells = []
        for label in targets:
            mine = [a for a in attempts if a.target == label]
            rewards = [a.reward for a in mine if a.reward is not None]
            errors = sum(a.error is not None for a in mine)
            text = _num(sum(rewards) / len(rewards)) if rewards else "n/a"
            cells.append(f"<td>{text}{f' ({errors} err)' if errors else ''}</td>")
        for i, _ in enumerate(result.comparisons):
            verdict = verdicts.get((i, sid), "")
            cells.append(f'<td class="{verdict}">{verdict}</td>')
        rows.append(f'<tr data-scenario="{_esc(sid)}"><td class="id">{_esc(sid)}</td>{"".join(cells)}</tr>')
        ordered = sorted(
            attempts, key=lambda a: (targets.index(a.target) if a.target in targets else 99, a.attempt)
        )
        details.append(
            f'<details class="scenario" data-scenario="{_esc(sid)}"><summary>{_esc(sid)}: {len(attempts)} attempt(s)'
            f"</summary>{''.join(_attempt_html(a) for a in ordered)}</details>"
        )
    table = (
        f'<div class="scroll"><table id="scenarios"><thead><tr><th class="id">scenario</th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )
    return table + '<h3>Attempts</h3><div id="attempts">' + "".join(details) + "</div>"


def render_page(result: EvalResult, *, report_link: str | None = None) -> str:
    """The whole evaluation page as one HTML string."""
    title = f"{result.project}/{result.model} — evaluation ({result.split})"
    sampling = ", ".join(f"{k}={v}" for k, v in result.sampling.items() if v is not None)
    info = f"{len(result.targets)} target(s) · {result.attempts_per_scenario} attempt(s) per scenario"
    info += f" · sampling {sampling}" if sampling else ""
    warning = ""
    if not result.held_out:
        ids = ", ".join(result.not_held_out_ids[:20]) + (" …" if len(result.not_held_out_ids) > 20 else "")
        warning = (
            f'<p class="warn" id="not-held-out">Not held out: {len(result.not_held_out_ids)} evaluated scenario(s) '
            f"were used in training ({_esc(ids)}); these numbers overstate how the model generalises.</p>"
        )
    link = (
        f' · <a href="{_esc(report_link)}" style="color:#93c5fd">training report</a>' if report_link else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>{CSS}{PAGE_CSS}</style></head>
<body><header><h1>{_esc(title)}</h1><p>{_esc(info)}{link}</p></header>
<main>{warning}
<section id="eval-curves"><h2>Reward and pass@k</h2><div class="charts">{reward_chart(result)}{pass_at_k_chart(result)}</div></section>
<section id="eval-summary"><h2>Per target</h2>{summary_tables(result)}</section>
<section id="eval-scenarios"><h2>Per scenario</h2>{scenario_table(result)}</section>
</main></body></html>
"""
