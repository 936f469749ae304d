"""Attack on the "turn" estimator's scale (issue 40): dividing every turn's centred return by the std of the FIRST
turn's returns lets a later turn's advantage grow without bound when the first returns nearly agree (a per-turn
judge's usual case: 8.5 in tests/test_ruler_turns.py's own group, 1e4 below), an outsized step on those tokens. A
turn's centred returns are divided by that turn's own spread instead, so no advantage exceeds sqrt(n - 1), as in
GRPO, and the exact properties (GRPO with gamma=1 and end rewards) stay exact."""

from __future__ import annotations

import math

from art_adapters.config import TrainConfig
from art_adapters.training.loss import group_advantages
from art_adapters.training.turn_credit import group_credit
from art_adapters.trajectories import LLMCall, Trajectory


def _trajectory(rewards: list[float | None], outcome: float) -> Trajectory:
    calls = [LLMCall(request={}, prompt_token_ids=[1, k], reward=r) for k, r in enumerate(rewards)]
    return Trajectory(llm_calls=calls, reward=outcome)


def test_no_turn_advantage_exceeds_grpo_s_bound() -> None:
    # first returns 1.0001 vs 1.0: nearly equal; the second turn's returns differ by 1
    group = [_trajectory([0.0001 + 1.0, -1.0], 1.0), _trajectory([0.0, 0.0], 1.0)]
    rows = group_credit(group, TrainConfig(advantage="turn")).calls  # type: ignore[union-attr]
    bound = math.sqrt(len(group) - 1) + 1e-9
    assert all(abs(a) <= bound for row in rows for a in row), rows
    assert rows[0][1] < 0 < rows[1][1]  # the sign (which second call did better) is kept
    # the team's per-turn judge group (scores 0.6/0.9, 0.1/0.6/0.9, 0.6/0.9; reward 0.5 each)
    judged = [_trajectory([0.6, 0.9], 0.5), _trajectory([0.1, 0.6, 0.9], 0.5), _trajectory([0.6, 0.9], 0.5)]
    rows = group_credit(judged, TrainConfig(advantage="turn", gamma=0.9)).calls  # type: ignore[union-attr]
    assert all(abs(a) <= math.sqrt(2) + 1e-9 for row in rows for a in row), rows


def test_the_exact_properties_still_hold_with_a_scale_per_turn() -> None:
    rewards, lengths = [1.0, 0.0, 0.25, 0.7, 0.0], [3, 1, 5, 2, 4]
    grpo = group_advantages(rewards)
    assert grpo is not None
    group = [_trajectory([None] * n, r) for n, r in zip(lengths, rewards, strict=True)]
    rows = group_credit(group, TrainConfig(advantage="turn")).calls  # type: ignore[union-attr]
    assert rows == [[grpo[i]] * n for i, n in enumerate(lengths)]
