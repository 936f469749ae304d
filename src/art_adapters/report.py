"""Local report of a run: one self-contained HTML page (inline SVG curves, step table, trajectory browser) + PNGs."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ._report_assets import CSS, SCRIPT
from .report_agents import agents_html, call_adapter
from .sources import CallSource
from .trajectories import LLMCall, Trajectory

MAIN_CURVES = (("reward_mean", "reward"), ("loss", "loss"), ("kl", "KL"))
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#d97706", "#0891b2", "#4b5563")
MAX_PER_STEP = 24
MAX_TEXT = 6000


def read_history(path: Path) -> list[dict[str, float]]:
    """history.jsonl rows as {key: number}, sorted by step; unreadable lines and non-numeric values are skipped."""
    rows: list[dict[str, float]] = []
    if not path.exists():
        return rows
    for n, line in enumerate(path.read_text().splitlines()):
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict):
            continue
        row = {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        row.setdefault("step", float(n))
        rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def read_trajectories(model_dir: Path) -> dict[str, dict[int, list[Trajectory]]]:
    """trajectories/{split}/{step:04d}.jsonl -> {split: {step: [Trajectory]}} (bad lines skipped)."""
    out: dict[str, dict[int, list[Trajectory]]] = {}
    root = model_dir / "trajectories"
    if not root.is_dir():
        return out
    for split_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for file in sorted(split_dir.glob("*.jsonl")):
            try:
                step = int(file.stem)
            except ValueError:
                continue
            items: list[Trajectory] = []
            for line in file.read_text().splitlines():
                if line.strip():
                    try:
                        items.append(Trajectory.model_validate_json(line))
                    except ValueError:
                        continue
            out.setdefault(split_dir.name, {})[step] = items
    return out


def _fmt(v: float, digits: int = 4) -> str:
    if not math.isfinite(v):
        return str(v)
    if float(v).is_integer() and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.3e}"


def svg_chart(
    title: str, points: list[tuple[float, float]], color: str, band: list[float] | None = None
) -> str:
    """A line chart as inline SVG: one <circle class="point"> per (step, value), with a tooltip."""
    w, h, left, right, top, bottom = 380, 210, 56, 14, 26, 30
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    lo = min(y - (band[i] if band else 0) for i, y in enumerate(ys))
    hi = max(y + (band[i] if band else 0) for i, y in enumerate(ys))
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def sy(y: float) -> float:
        return top + (hi - y) / (hi - lo) * (h - top - bottom)

    parts = [
        f'<svg class="chart" data-metric="{html.escape(title)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
    ]
    parts.append(f'<text class="title" x="{left}" y="16">{html.escape(title)}</text>')
    for frac in (0.0, 0.5, 1.0):
        y = lo + frac * (hi - lo)
        parts.append(f'<line class="grid" x1="{left}" x2="{w - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}"/>')
        parts.append(
            f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{_fmt(round(y) if abs(y) >= 100 else y, 3)}</text>'
        )
    for x in sorted({x0, x1}):
        parts.append(f'<text x="{sx(x):.1f}" y="{h - 10}" text-anchor="middle">{int(x)}</text>')
    parts.append(f'<text x="{(left + w - right) / 2:.1f}" y="{h - 10}" text-anchor="middle">step</text>')
    if band:
        upper = [f"{sx(x):.1f},{sy(y + b):.1f}" for (x, y), b in zip(points, band, strict=True)]
        lower = [
            f"{sx(x):.1f},{sy(y - b):.1f}" for (x, y), b in reversed(list(zip(points, band, strict=True)))
        ]
        parts.append(f'<polygon class="band" fill="{color}" points="{" ".join(upper + lower)}"/>')
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline class="line" stroke="{color}" points="{line}"/>')
    for x, y in points:
        parts.append(
            f'<circle class="point" data-step="{int(x)}" data-value="{y!r}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" '
            f'fill="{color}"><title>step {int(x)}: {_fmt(y)}</title></circle>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _series(history: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in history if key in r and math.isfinite(r[key])]


def charts_html(history: list[dict[str, float]]) -> str:
    keys = sorted({k for r in history for k in r} - {"step"})
    main = [k for k, _ in MAIN_CURVES if k in keys]
    out: list[str] = []
    for i, (key, label) in enumerate(MAIN_CURVES):
        if key not in main:
            continue
        band = None
        if key == "reward_mean" and all("reward_std" in r for r in history if key in r):
            band = [r["reward_std"] for r in history if key in r and math.isfinite(r[key])]
        out.append(svg_chart(label, _series(history, key), COLORS[i], band))
    for j, key in enumerate(k for k in keys if k not in main and k != "reward_std"):
        out.append(svg_chart(key, _series(history, key), COLORS[(j + 3) % len(COLORS)]))
    return "".join(out) or "<p>No history.jsonl rows yet.</p>"


def table_html(history: list[dict[str, float]]) -> str:
    if not history:
        return "<p>No steps recorded.</p>"
    keys = ["step"] + sorted({k for r in history for k in r} - {"step"})
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt(r[k]) if k in r else ''}</td>" for k in keys) + "</tr>" for r in history
    )
    return f'<div class="scroll"><table id="steps"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def call_tokens(call: LLMCall) -> list[tuple[str, float | None, int | None]]:
    """(piece, logprob, id) per sampled token: pieces from the response's logprobs.content, else the ids."""
    content: list[dict[str, Any]] = []
    for choice in call.choices():
        if choice.get("index", 0) == 0:
            content = ((choice.get("logprobs") or {}).get("content")) or []
    ids = call.completion_token_ids or []
    lps = call.logprobs or []
    out: list[tuple[str, float | None, int | None]] = []
    for j in range(max(len(ids), len(content))):
        entry = content[j] if j < len(content) else {}
        tid = ids[j] if j < len(ids) else None
        lp = lps[j] if j < len(lps) else entry.get("logprob")
        piece = entry.get("token") if entry.get("token") is not None else f"⟨{tid}⟩"
        out.append((piece, lp if lp is None or math.isfinite(lp) else None, tid))
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    text = "" if content is None else str(content)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " …"


def where_label(source: CallSource) -> str:
    """Where a call came from, as the trajectory browser groups calls: its node, else its agent, else its role."""
    if source.node_path is not None:
        label = f"node {source.node_path}"
    elif source.agent is not None:
        label = "agent " + " > ".join(source.agent_path or [source.agent])
        if source.handoffs:
            label += f" (after {' > '.join(source.handoffs)})"
    else:
        label = ""
    if source.role:
        label = f"{label} · role {source.role}" if label else f"role {source.role}"
    return label


def trajectory_view(t: Trajectory, model_key: str | None = None) -> dict[str, Any]:
    """What the browser shows of a trajectory; each call with the adapter and version that served it (`model_key`,
    `{project}/{name}`, tells the model's own adapters from other models)."""
    messages = []
    for m in t.messages():
        calls = [
            {
                "name": (c.get("function") or {}).get("name"),
                "arguments": _text((c.get("function") or {}).get("arguments")),
            }
            for c in m.get("tool_calls") or []
        ]
        messages.append(
            {
                "role": m.get("role", "?"),
                "name": m.get("name"),
                "content": _text(m.get("content")),
                "tool_calls": calls,
            }
        )
    calls = [
        {
            "model": c.model,
            "tokens": call_tokens(c),
            "latency_s": c.latency_s,
            "error": c.error,
            "where": where_label(c.source),
            "version": c.policy_version,
            "served_model": c.served_model,
            "adapter": call_adapter(c, model_key),
        }
        for c in t.llm_calls
    ]
    return {
        "reward": t.reward,
        "metrics": t.metrics,
        "group": t.metadata.get("group_index"),
        "messages": messages,
        "calls": calls,
        "logs": t.logs[-10:],
    }


def save_pngs(history: list[dict[str, float]], out_dir: Path) -> list[Path]:
    """reward.png, loss.png, kl.png (whichever the history has), via matplotlib's Agg backend; [] without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths: list[Path] = []
    for i, (key, label) in enumerate(MAIN_CURVES):
        points = _series(history, key)
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", markersize=3, color=COLORS[i])
        if key == "reward_mean":
            std = [r.get("reward_std", 0.0) for r in history if key in r and math.isfinite(r[key])]
            ax.fill_between(
                xs,
                [y - s for y, s in zip(ys, std, strict=True)],
                [y + s for y, s in zip(ys, std, strict=True)],
                color=COLORS[i],
                alpha=0.15,
            )
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{label.lower()}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _model_key(model_dir: Path) -> str | None:
    """`{project}/{name}` of the run in `model_dir`: from its place (`{project}/models/{name}`), else from its
    `model.json` (a copied run folder); None when neither says (calls' adapters are then guessed from their names)."""
    if model_dir.parent.name == "models":
        return f"{model_dir.parent.parent.name}/{model_dir.name}"
    try:
        saved = json.loads((model_dir / "model.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        isinstance(saved, dict)
        and isinstance(saved.get("project"), str)
        and isinstance(saved.get("name"), str)
    ):
        return f"{saved['project']}/{saved['name']}"
    return None


def write_report(model_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `report.html` (default: in model_dir) and the curves as PNGs beside it; returns the HTML path."""
    model_dir = Path(model_dir)
    out_path = Path(out) if out is not None else model_dir / "report.html"
    if out_path.suffix.lower() != ".html":
        out_path = out_path / "report.html"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    history = read_history(model_dir / "history.jsonl")
    trajectories = read_trajectories(model_dir)
    model_key = _model_key(model_dir)
    data = {
        "trajectories": {
            split: {
                str(step): [trajectory_view(t, model_key) for t in items[:MAX_PER_STEP]]
                for step, items in steps.items()
            }
            for split, steps in trajectories.items()
        }
    }
    payload = json.dumps(data, default=str).replace("</", "<\\/")
    name = html.escape(
        f"{model_dir.parent.parent.name}/{model_dir.name}"
        if model_dir.parent.name == "models"
        else model_dir.name
    )
    total = sum(len(v) for steps in trajectories.values() for v in steps.values())
    evaluation = (
        model_dir / "evaluation.html"
    )  # written by art_adapters.evaluation.sinks.write_report_section
    link = ""
    if evaluation.exists():
        href = (
            "evaluation.html"
            if out_path.parent.resolve() == model_dir.resolve()
            else evaluation.resolve().as_uri()
        )
        link = f' · <a id="evaluation-link" href="{html.escape(href)}" style="color:#93c5fd">evaluation</a>'
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{name} — art-adapters report</title>
<style>{CSS}</style></head>
<body><header><h1>{name}</h1><p>{len(history)} step(s) in history.jsonl · {total} saved trajectories{link}</p></header>
<main>
<section id="curves"><h2>Curves</h2><div class="charts">{charts_html(history)}</div></section>
<section id="table"><h2>Per step</h2>{table_html(history)}</section>
{agents_html(history, trajectories, model_key)}
<section id="browser"><h2>Trajectories</h2>
<div class="controls"><label>split <select id="split"></select></label><label>step <select id="step"></select></label>
<span class="legend">sampled tokens: the redder, the less likely (hover for id and logprob)</span></div>
<div id="trajectory-list"></div><div id="viewer"></div></section>
</main>
<script type="application/json" id="report-data">{payload}</script>
<script>{SCRIPT}</script>
</body></html>
"""
    out_path.write_text(page, encoding="utf-8")
    save_pngs(history, out_path.parent)
    return out_path


def report_command(model_dir: str, out: str | None = None) -> None:
    """`art-adapters report <model dir> [--out PATH]`: write the report and print where it is."""
    path = write_report(model_dir, out)
    pngs = [n for n in ("reward.png", "loss.png", "kl.png") if (path.parent / n).exists()]
    print(f"report: {path}" + (f"  (curves: {', '.join(pngs)})" if pngs else ""))
