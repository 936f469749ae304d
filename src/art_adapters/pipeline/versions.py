"""Which policy version sampled each trajectory, as the async pipeline counts it: only calls the trained model
served count (a judge or partner model on the same server does not), then ART's per-Choice records, then what
the trajectory says, then the versions served while its rollout ran."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ..model import TrainableModel
from ..training.versions import FutureVersionError
from ..trajectories import Trajectory, TrajectoryGroup

__all__ = ["FutureVersionError"]  # the trainer's (training/versions.py): one error, raised by both

log = logging.getLogger(__name__)


def own_names(model: TrainableModel) -> set[str]:
    """The names a served adapter of `model` carries before its `@step` (the gateway's `{project}/{name}@k`); with
    per-agent adapters also `{name}.*`, which stands for every agent's adapter (`{project}/{name}.{adapter}@k`),
    those added mid-run included."""
    names = {f"{model.project}/{model.name}", model.name, model.get_inference_name()}
    if getattr(model, "adapters", None) is not None:
        names |= {f"{name}.*" for name in names}
    return names


def _own(served: str | None, names: set[str]) -> bool:
    if not served:
        return False
    base = served.rpartition("@")[0]
    return base in names or f"{base.rpartition('.')[0]}.*" in names


def sampled_spans(trajectory: Trajectory, names: set[str]) -> Iterator[tuple[int, int]]:
    """(version, completion tokens) of each completion the trained model sampled in `trajectory`: its captured
    calls where it has any, else the Choices of its histories (their `policy_version`, else their
    `policy_token_spans`, ART's form)."""
    if trajectory.llm_calls:
        for call in trajectory.llm_calls:
            if call.policy_version is not None and _own(call.served_model, names):
                yield call.policy_version, max(len(call.completion_token_ids or []), 1)
        return
    for item in _choices(trajectory):
        version = _extra(item, "policy_version")
        spans = _extra(item, "policy_token_spans") or []
        tokens = len(_extra(item, "token_ids") or []) or 1
        if version is not None and not spans:
            served = _extra(item, "served_model")  # set by our capture; a hand-made Choice has none
            if served is None or _own(served, names):
                yield int(version), tokens
            continue
        for span in spans:
            try:
                version, start, end = (
                    int(span["policy_version"]),
                    int(span["start_token"]),
                    int(span["end_token"]),
                )
            except (KeyError, TypeError, ValueError):
                continue
            if end > start and (not span.get("lora_slot") or _own(span["lora_slot"], names)):
                yield version, end - start


def stamp_versions(group: TrajectoryGroup, names: set[str], started: int, ended: int) -> None:
    """Set each trajectory's `initial_policy_version` / `final_policy_version` where unset: from what the trained
    model sampled in it, else the versions served when its rollout began and ended (ART's rule)."""
    for trajectory in group.trajectories:
        versions = [version for version, _ in sampled_spans(trajectory, names)]
        if trajectory.initial_policy_version is None:
            trajectory.initial_policy_version = min(versions, default=started)
        if trajectory.final_policy_version is None:
            trajectory.final_policy_version = max(versions, default=ended)


def group_version(group: TrajectoryGroup, default: int) -> int:
    """The oldest policy that sampled any of the group's trajectories (its staleness is counted from it)."""
    versions = [t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None]
    return min(versions, default=default)


def check_not_future(group: TrajectoryGroup, newest: int) -> None:
    """Refuse a group sampled by a version newer than any this run has served."""
    versions = [t.final_policy_version for t in group.trajectories if t.final_policy_version is not None]
    if versions and max(versions) > newest:
        raise FutureVersionError(
            f"a rollout reports policy version {max(versions)}, but the newest version this run has trained is "
            f"{newest}: the server answering it serves another run of this model (or the trajectory's "
            "initial_policy_version / final_policy_version were set by hand)"
        )


def token_weighted_ages(
    batch: Iterable[TrajectoryGroup], names: set[str], step: int
) -> list[tuple[float, float]]:
    """(age in steps, completion tokens) per trajectory: how far behind `step` the policy that sampled each of its
    tokens was, averaged over its tokens (ART's `offpolicy/token_weighted_policy_age_steps`)."""
    out = []
    for group in batch:
        for trajectory in group.trajectories:
            spans = list(sampled_spans(trajectory, names))
            if not spans and trajectory.initial_policy_version is not None:
                spans = [(trajectory.initial_policy_version, 1)]
            weight = sum(tokens for _, tokens in spans)
            if weight:
                age = sum((step - version) * tokens for version, tokens in spans) / weight
                out.append((float(age), float(weight)))
    return out


def weighted_percentile(points: list[tuple[float, float]], q: float) -> float:
    """The value below which a fraction `q` of the total weight lies."""
    if not points:
        return 0.0
    ordered = sorted(points)
    target, running = q * sum(w for _, w in ordered), 0.0
    for value, weight in ordered:
        running += weight
        if running >= target:
            return value
    return ordered[-1][0]


def _choices(trajectory: Trajectory) -> Iterator[Any]:
    yield from (i for i in trajectory.messages_and_choices if not isinstance(i, dict) or "message" in i)
    for history in trajectory.additional_histories:
        yield from (i for i in history.messages_and_choices if not isinstance(i, dict) or "message" in i)


def _extra(item: Any, key: str) -> Any:
    if isinstance(item, dict):
        return item.get(key)
    value = getattr(item, key, None)
    if value is None and getattr(item, "model_extra", None):
        value = item.model_extra.get(key)
    return value
