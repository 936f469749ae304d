"""Weights & Biases logging of training steps and sample trajectories (wandb is imported only when used)."""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ..trajectories import Trajectory, TrajectoryGroup, reward_missing

# history.jsonl keys, in the order a dashboard shows them; any other numeric key is logged too
STEP_KEYS = (
    "reward_mean",
    "reward_std",
    "loss",
    "grad_norm",
    "kl",
    "clip_fraction",
    "trained_tokens",
    "exception_rate",
    "skipped_groups",
)
COLUMNS = [
    "step",
    "split",
    "group",
    "index",
    "reward",
    "metrics",
    "llm_calls",
    "completion_tokens",
    "last_answer",
    "messages",
]


def _numeric(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return value
    return None


def group_metrics(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """reward_mean, reward_std, trajectories and exception_rate over some groups (when training does not log them)."""
    groups = list(groups)
    rewards = [
        t.reward for g in groups for t in g.trajectories if math.isfinite(t.reward) and not reward_missing(t)
    ]
    errors = sum(len(g.exceptions) for g in groups)
    total = len(rewards) + errors
    out: dict[str, float] = {"trajectories": float(len(rewards))}
    if rewards:
        out["reward_mean"] = statistics.fmean(rewards)
        out["reward_std"] = statistics.pstdev(rewards)
    if total:
        out["exception_rate"] = errors / total
    return out


def _row(step: int, split: str, gi: int, ti: int, t: Trajectory) -> list[Any]:
    messages = t.messages()
    answer = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
    tokens = sum(len(c.completion_token_ids or []) for c in t.llm_calls)
    return [
        step,
        split,
        gi,
        ti,
        t.reward,
        json.dumps(t.metrics),
        len(t.llm_calls),
        tokens,
        str(answer.get("content") or json.dumps(answer.get("tool_calls") or ""))[:2000],
        json.dumps(messages, default=str)[:20000],
    ]


class WandbLogger:
    """`WandbLogger("my-project", name="run-1")`: `log_step(step, metrics)`, `log_trajectories(step, groups)`.

    Runs offline with WANDB_MODE=offline. A failing wandb warns and turns the logger into a no-op: logging never
    stops training.
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ) -> None:
        self.run: Any = None
        try:
            import wandb

            self._wandb = wandb
            self.run = wandb.init(project=project, name=name, config=dict(config or {}), **init_kwargs)
        except Exception as error:  # no wandb, no login, bad settings: warn, keep training
            warnings.warn(f"W&B logging disabled: {error!r}", RuntimeWarning, stacklevel=2)

    def log_step(
        self, step: int, metrics: Mapping[str, Any], *, prefix: str = "train/"
    ) -> dict[str, float | int]:
        """Log one training step's numbers (a history.jsonl row works as is); returns what was logged."""
        logged = {f"{prefix}{k}": v for k in STEP_KEYS if (v := _numeric(metrics.get(k))) is not None}
        for k, value in metrics.items():
            if k not in STEP_KEYS and k != "step" and (v := _numeric(value)) is not None:
                logged[f"{prefix}{k}"] = v
        self._log(logged, step)
        return logged

    def log_groups(
        self, step: int, groups: Iterable[TrajectoryGroup], *, split: str = "train"
    ) -> dict[str, float]:
        """Reward statistics and exception rate computed from the groups themselves, under `{split}/`."""
        metrics = group_metrics(groups)
        self._log({f"{split}/{k}": v for k, v in metrics.items()}, step)
        return metrics

    def log_trajectories(
        self,
        step: int,
        groups: Iterable[TrajectoryGroup | Trajectory],
        *,
        split: str = "train",
        max_rows: int = 32,
    ) -> int:
        """A wandb.Table of up to `max_rows` sample trajectories (messages, reward, metrics); returns the rows."""
        rows: list[list[Any]] = []
        for gi, group in enumerate(groups):
            items = group.trajectories if isinstance(group, TrajectoryGroup) else [group]
            for ti, trajectory in enumerate(items):
                if len(rows) < max_rows:
                    rows.append(_row(step, split, gi, ti, trajectory))
        if self.run is not None and rows:
            try:
                self._log({f"{split}/trajectories": self._wandb.Table(columns=COLUMNS, data=rows)}, step)
            except Exception as error:
                warnings.warn(f"W&B table logging failed: {error!r}", RuntimeWarning, stacklevel=2)
        return len(rows)

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as error:
                warnings.warn(f"W&B finish failed: {error!r}", RuntimeWarning, stacklevel=2)
            self.run = None

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None or not data:
            return
        try:
            self.run.log(data, step=step)
        except Exception as error:
            warnings.warn(f"W&B log failed: {error!r}", RuntimeWarning, stacklevel=3)
