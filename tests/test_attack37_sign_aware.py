"""Attack on the sign-aware (TOPR) weight (issue 37 §4): 'a positive-advantage token gets clamp(rho, 1, C), never
below 1'. With a cap below 1 (truncated_importance_sampling=0.5 is accepted) torch's clamp returns C, so a good
token was discounted to 0.5: the pair is refused instead."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_adapters.config import TrainConfig


@pytest.mark.parametrize("cap", [{"truncated_importance_sampling": 0.5}, {"off_policy_cap": 0.9}])
def test_a_sign_aware_weight_with_a_cap_below_one_is_refused(cap: dict[str, float]) -> None:
    with pytest.raises(ValidationError, match="sign_aware"):
        TrainConfig(behaviour_weight="sign_aware", **cap)


def test_the_truncated_weight_may_still_cap_below_one() -> None:
    assert TrainConfig(truncated_importance_sampling=0.5).off_policy_cap == 0.5
    assert TrainConfig(behaviour_weight="sign_aware", truncated_importance_sampling=1.0).off_policy_cap == 1.0
