"""Which policy version sampled each trained token, where training happens: ART's `policy_token_spans` read per
token, and a step refused when a token claims a version newer than the trainer's (`FutureVersionError`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..trajectories import TrajectoryGroup


class FutureVersionError(RuntimeError):
    """A group claims a policy version the trainer has not produced yet: the server is serving another run."""


def span_versions(spans: Any, tokens: int) -> list[int | None] | None:
    """Each completion token's policy version from ART's `policy_token_spans` (half-open `[start_token,
    end_token)` intervals, each with its `policy_version`); a token no span covers is None (unknown). None when
    there are no usable spans. A malformed span is refused: it would silently misdate the tokens."""
    if not spans:
        return None
    if not isinstance(spans, list):
        raise ValueError(f"policy_token_spans must be a list of spans, not {type(spans).__name__}")
    versions: list[int | None] = [None] * tokens
    for span in spans:
        try:
            version, start, end = (
                _integer(span["policy_version"]),
                _integer(span["start_token"]),
                _integer(span["end_token"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise ValueError(
                f"a policy_token_spans entry needs integer policy_version, start_token and end_token: {span!r}"
            ) from error
        if version < 0 or not 0 <= start < end:
            raise ValueError(
                f"policy_token_spans entry {span!r} is not a non-empty interval of a version >= 0"
            )
        for position in range(start, min(end, tokens)):
            versions[position] = version
    return versions


def _integer(value: Any) -> int:
    """An integer as JSON may carry it (3 or 3.0); a bool, a fraction, a string or an infinity is refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


def check_not_future(
    groups: Iterable[TrajectoryGroup], token_versions: Iterable[int | None], step: int
) -> None:
    """Refuse a step whose tokens (or trajectories' `final_policy_version`) claim a version newer than `step`, the
    newest this trainer has produced: the pipeline's rule (`pipeline.versions.check_not_future`), applied by the
    trainer itself, so `model.train` / `backend.train` on any backend refuses what the async pipeline refuses."""
    claimed = [v for v in token_versions if v is not None]
    claimed += [
        t.final_policy_version for g in groups for t in g.trajectories if t.final_policy_version is not None
    ]
    newest = max(claimed, default=None)
    if newest is not None and newest > step:
        raise FutureVersionError(
            f"a trajectory reports policy version {newest}, but the newest version this trainer has trained is "
            f"{step}: its tokens were sampled by another run of this model (a server serving another run, a "
            "resumed run that lost steps), or its versions were set by hand; refusing to train on them"
        )
