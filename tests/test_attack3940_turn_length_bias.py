"""Attack on "turn"'s no-length-bias claim (issue 40): the team's simulation checks only each trajectory's FIRST
turn, where "turn" is GRPO on the total return and is flat by construction. Here every later turn too: in verl RFC
#7244's case (each extra turn earns c, the outcome takes it back) the mean advantage at turn t is the same for every
length that reaches t, under "turn"; per-turn-index normalisation is not (the check can fail). This held."""

from __future__ import annotations

import random

from art_adapters.config import TrainConfig
from art_adapters.training.turn_credit import group_credit
from art_adapters.trajectories import LLMCall, Trajectory


def _trajectory(n: int, c: float, outcome: float) -> Trajectory:
    calls = [
        LLMCall(request={}, prompt_token_ids=[1, 2, t], reward=c if t < n - 1 else None) for t in range(n)
    ]
    return Trajectory(llm_calls=calls, reward=outcome)


def _naive(rewards: list[list[float]]) -> list[list[float]]:
    longest = max(len(r) for r in rewards)
    means = []
    for k in range(longest):
        reached = [r[k] for r in rewards if len(r) > k]
        means.append(sum(reached) / len(reached))
    return [[sum(r[k] - means[k] for k in range(t, len(r))) for t in range(len(r))] for r in rewards]


def test_every_turn_s_mean_advantage_is_flat_in_length() -> None:
    rng = random.Random(40)
    c, size, groups = 1.0, 8, 2000
    turn: dict[tuple[int, int], list[float]] = {}
    naive: dict[tuple[int, int], list[float]] = {}
    for _ in range(groups):
        lengths = [rng.randint(1, 4) for _ in range(size)]
        outcomes = [-c * (n - 1) + rng.gauss(0.0, 1.0) for n in lengths]
        group = [_trajectory(n, c, o) for n, o in zip(lengths, outcomes, strict=True)]
        credit = group_credit(group, TrainConfig(advantage="turn", scale_rewards=False))
        assert credit is not None
        plain = _naive([[c] * (n - 1) + [o] for n, o in zip(lengths, outcomes, strict=True)])
        for n, row, naive_row in zip(lengths, credit.calls, plain, strict=True):
            for t in range(n):
                turn.setdefault((t, n), []).append(row[t])
                naive.setdefault((t, n), []).append(naive_row[t])

    def spread(values: dict[tuple[int, int], list[float]], t: int) -> float:
        means = [sum(v) / len(v) for (k, _), v in values.items() if k == t]
        return max(means) - min(means)

    for t in (1, 2):  # lengths t+1..4 reach turn t; >= ~1000 samples per cell, s.e. <= ~0.035
        assert spread(turn, t) < 0.15, (t, {k: sum(v) / len(v) for k, v in turn.items() if k[0] == t})
        assert spread(naive, t) > 0.5, t
