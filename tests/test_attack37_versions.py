"""Attack on ART's `policy_token_spans` read where training happens (issue 37 §2): a span whose version or bounds
are not integers (2.7, True, 0.9, an infinity from JSON's 1e400) is refused with the named error, never rounded
down into a version that misdates the tokens, nor an OverflowError that names nothing."""

from __future__ import annotations

import pytest

from art_adapters.training.versions import span_versions


@pytest.mark.parametrize(
    "span",
    [
        {"policy_version": 2.7, "start_token": 0, "end_token": 2},
        {"policy_version": True, "start_token": 0, "end_token": 2},
        {"policy_version": "3", "start_token": 0, "end_token": 2},
        {"policy_version": 1, "start_token": 0.9, "end_token": 2},
        {"policy_version": float("inf"), "start_token": 0, "end_token": 2},
        {"policy_version": 1, "start_token": 0, "end_token": float("nan")},
    ],
)
def test_a_span_that_is_not_integers_is_refused(span: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="policy_token_spans entry needs integer"):
        span_versions([span], 3)


def test_integral_numbers_as_json_carries_them_are_read() -> None:
    span = {"policy_version": 2.0, "start_token": 0, "end_token": 2}
    assert span_versions([span], 3) == [2, 2, None]
