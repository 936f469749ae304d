"""What `model.log` and every step record in a model's folder: rollout metrics of trajectory groups, the history row,
and the best checkpoint by a history metric."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import checkpoints
from .trajectories import Trajectory, TrajectoryGroup, reward_missing
from .untrusted import check_name


def all_trajectories(groups: list[TrajectoryGroup]) -> list[Trajectory]:
    return [t for group in groups for t in group.trajectories]


def rollout_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std, trajectory count, exception rate and the mean of each numeric trajectory metric. A
    trajectory whose reward is missing (flagged `reward_missing`) is counted in `reward_missing`, never averaged
    in as its 0.0 placeholder."""
    trajectories = all_trajectories(groups)
    rewards = [t.reward for t in trajectories if not reward_missing(t)]
    exceptions = sum(len(g.exceptions) for g in groups)
    total = len(trajectories) + exceptions
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
    within = [
        _std([t.reward for t in g.trajectories if not reward_missing(t)]) for g in groups if g.trajectories
    ]
    out = {
        "reward_mean": mean,
        "reward_std": std,
        # ART's name: the mean of each group's own reward std (the spread GRPO learns from)
        "reward_std_dev": sum(within) / len(within) if within else 0.0,
        "trajectories": float(len(trajectories)),
        "exceptions": float(exceptions),
        "exception_rate": exceptions / total if total else 0.0,
    }
    if len(rewards) < len(trajectories):
        out["reward_missing"] = float(len(trajectories) - len(rewards))
    keys = sorted({k for t in trajectories for k, v in t.metrics.items() if isinstance(v, int | float)})
    for key in keys:
        values = [float(t.metrics[key]) for t in trajectories if isinstance(t.metrics.get(key), int | float)]
        out.setdefault(f"metric/{key}", sum(values) / len(values))
    return out


def _std(values: list[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def best_step(history: list[dict[str, Any]], metric: str, steps: set[int]) -> int | None:
    """The checkpoint step whose history rows score highest on `metric` (`val/reward`, `train/reward`, ...)."""
    best: tuple[float, int] | None = None
    for row in history:
        value = row.get(metric)
        split = row.get("split", "")
        if value is None and metric.startswith(f"{split}/"):  # "train/reward" -> a train row's reward_mean
            key = metric[len(split) + 1 :]
            value = row.get("reward_mean" if key == "reward" else key)
        step = row.get("step")
        if isinstance(value, int | float) and step in steps and (best is None or value > best[0]):
            best = (float(value), int(step))
    return best[1] if best else None


def record_log(
    directory: str | Path,
    groups: list[TrajectoryGroup],
    split: str,
    step: int,
    metrics: dict[str, float] | None = None,
) -> dict[str, float]:
    """`model.log`'s record at `step`: the groups' trajectories appended to `trajectories/{split}/{step:04d}.jsonl`
    and one `history.jsonl` row of their `{split}/...` rollout metrics (`{split}/reward` is ART's name for the
    mean) plus `metrics`, prefixed `{split}/` unless they already name a section. Returns the row's metrics."""
    check_name("split", split)
    row: dict[str, float] = {}
    trajectories = all_trajectories(groups)
    if groups:
        path = checkpoints.trajectories_path(directory, split, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # several log() calls at one step add up
            for trajectory in trajectories:
                f.write(trajectory.model_dump_json() + "\n")
        rollout = rollout_metrics(groups)
        row = {f"{split}/{key}": value for key, value in rollout.items()}
        row[f"{split}/reward"] = rollout["reward_mean"]
    for key, value in (metrics or {}).items():
        row[key if "/" in key else f"{split}/{key}"] = value
    if row:
        checkpoints.append_history(directory, {"step": step, "split": split, **row})
    return row
