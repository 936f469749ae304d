"""The evaluation's statistics on fixed data: pass@k against brute-force enumeration, bootstrap coverage over
1,000 seeded trials, the paired interval against the unpaired one, and per-scenario comparisons."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from art_adapters.evaluation.intervals import Interval
from art_adapters.evaluation.stats import _t_quantile, compare, mean_ci, paired_diff_ci, pass_at_k


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_of_every_k_subset() -> None:
    checked = 0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (
                    n,
                    c,
                    k,
                )
                checked += 1
    assert checked == sum(n * (n + 1) for n in range(1, 9))


def test_pass_at_k_edges_and_large_n_stay_finite() -> None:
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 1, 10) == 1.0
    # C(1000, 500) overflows a float; the product form does not
    value = pass_at_k(1000, 1, 500)
    assert value == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [
        (4, 1, 0, "k must be between 1 and n=4"),
        (4, 1, 5, "k must be between 1 and n=4"),
        (4, -1, 1, "c .successes. must be between 0 and n=4"),
        (4, 5, 1, "c .successes. must be between 0 and n=4"),
        (0, 0, 1, "n .attempts. must be >= 1"),
        (4, 1.0, 1, "c must be an int"),
        (4, True, 1, "c must be an int"),
    ],
)
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def _scenario_means(rng: random.Random, scenarios: int, attempts: int) -> list[float]:
    """Per-scenario mean rewards as an evaluation sees them: each scenario has its own success probability
    (Beta(2, 3), mean 0.4) and `attempts` pass/fail draws."""
    out = []
    for _ in range(scenarios):
        p = rng.betavariate(2, 3)
        out.append(sum(rng.random() < p for _ in range(attempts)) / attempts)
    return out


def test_mean_ci_covers_the_true_mean_about_95_percent_of_1000_trials() -> None:
    # 20 scenarios x 4 pass/fail attempts; resamples kept at 400 so 1,000 trials run in a couple of seconds
    covered = 0
    for trial in range(1000):
        values = _scenario_means(random.Random(10_000 + trial), scenarios=20, attempts=4)
        ci = mean_ci(values, resamples=400, seed=trial)
        covered += ci.low <= 0.4 <= ci.high
    assert 0.92 <= covered / 1000 <= 0.98, covered


def test_mean_ci_covers_on_few_scenarios_where_a_plain_percentile_interval_does_not() -> None:
    # 10 normal scenarios: the plain percentile bootstrap covers ~89 %; the expanded interval ~94 %
    covered = 0
    for trial in range(1000):
        rng = random.Random(20_000 + trial)
        values = [rng.gauss(0.5, 0.2) for _ in range(10)]
        ci = mean_ci(values, resamples=400, seed=trial)
        covered += ci.low <= 0.5 <= ci.high
    assert 0.92 <= covered / 1000 <= 0.98, covered


def test_paired_diff_ci_covers_the_true_gain_about_95_percent_of_1000_trials() -> None:
    covered = 0
    for trial in range(1000):
        rng = random.Random(30_000 + trial)
        difficulty = [rng.gauss(0.0, 1.0) for _ in range(20)]
        a = [d + rng.gauss(0.0, 0.3) for d in difficulty]
        b = [d + 0.2 + rng.gauss(0.0, 0.3) for d in difficulty]
        ci = paired_diff_ci(a, b, resamples=400, seed=trial)
        covered += ci.low <= 0.2 <= ci.high
    assert 0.92 <= covered / 1000 <= 0.98, covered


def _unpaired_diff_ci(a: list[float], b: list[float], resamples: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    diffs = sorted(
        sum(rng.choices(b, k=len(b))) / len(b) - sum(rng.choices(a, k=len(a))) / len(a)
        for _ in range(resamples)
    )
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def test_paired_ci_is_narrower_than_unpaired_on_correlated_scenarios() -> None:
    rng = random.Random(7)
    difficulty = [rng.random() for _ in range(40)]  # what both targets share: how hard each scenario is
    a = [min(1.0, max(0.0, d + rng.gauss(0, 0.05))) for d in difficulty]
    b = [min(1.0, max(0.0, d + 0.1 + rng.gauss(0, 0.05))) for d in difficulty]
    paired = paired_diff_ci(a, b, seed=1)
    low, high = _unpaired_diff_ci(a, b, resamples=2000, seed=1)
    assert paired.mean == pytest.approx(sum(b) / 40 - sum(a) / 40)
    assert paired.low > 0  # the paired interval sees the gain...
    assert low < 0  # ...the unpaired one cannot tell it from scenario difficulty
    assert (paired.high - paired.low) < 0.5 * (high - low)


def test_mean_ci_degenerate_inputs() -> None:
    one = mean_ci([0.7])
    assert one.mean == 0.7 and math.isnan(one.low) and math.isnan(one.high)
    equal = mean_ci([0.1] * 37)
    assert equal == Interval(0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])
    with pytest.raises(ValueError, match="value 1 must be a finite number"):
        mean_ci([0.5, math.nan])
    with pytest.raises(ValueError, match="value 0 must be a finite number"):
        mean_ci([math.inf, 1.0])
    with pytest.raises(ValueError, match="confidence must be"):
        mean_ci([0.1, 0.2], confidence=1.0)
    with pytest.raises(ValueError, match="resamples must be"):
        mean_ci([0.1, 0.2], resamples=0)
    with pytest.raises(ValueError, match="sequence of numbers"):
        mean_ci("0.5")  # type: ignore[arg-type]


def test_mean_ci_is_seeded_and_brackets_the_mean() -> None:
    values = [0.0, 0.13, 0.97, 0.41, 0.77, 1.0, 0.22, 0.5]
    first, again, other = mean_ci(values, seed=3), mean_ci(values, seed=3), mean_ci(values, seed=4)
    assert first == again
    assert first != other
    assert first.mean == pytest.approx(0.5)
    assert 0.0 <= first.low < 0.5 < first.high <= 1.0
    assert abs(first.low - other.low) < 0.05  # a different seed wobbles the bounds a little, no more
    wider = mean_ci(values, confidence=0.99, seed=3)
    assert wider.low <= first.low and wider.high >= first.high


def test_paired_diff_ci_refuses_unpaired_lengths_and_handles_one_and_equal_pairs() -> None:
    with pytest.raises(ValueError, match="got 3 and 2 values"):
        paired_diff_ci([0.1, 0.2, 0.3], [0.1, 0.2])
    with pytest.raises(ValueError, match=r"\(b\): no values"):
        paired_diff_ci([0.1], [])
    single = paired_diff_ci([0.2], [0.5])
    assert single.mean == pytest.approx(0.3) and math.isnan(single.low)
    shifted = paired_diff_ci([0.0, 0.5, 1.0], [0.25, 0.75, 1.25])
    assert shifted == Interval(0.25, 0.25, 0.25)


def test_t_quantile_matches_tables() -> None:
    for df, expected in ((1, 12.706), (2, 4.303), (9, 2.262), (19, 2.093), (99, 1.984), (1000, 1.962)):
        assert _t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3), df


def test_compare_sorts_scenarios_by_change_with_ties_and_tolerance() -> None:
    a = {"s1": 0.5, "s2": 0.5, "s3": 0.5, "s4": 0.5, "s5": 1.0, "only_a": 0.0}
    b = {"s5": 1.0, "s4": 0.5 + 1e-12, "s3": 0.25, "s2": 0.5, "s1": 0.75, "only_b": 1.0}
    changes = compare(a, b)
    assert changes.improved == ["s1"]
    assert changes.same == ["s2", "s4", "s5"]  # exact tie, a float wobble under tolerance, both perfect
    assert changes.worse == ["s3"]
    loose = compare(a, b, tolerance=0.3)
    assert loose.improved == [] and loose.worse == [] and loose.same == ["s1", "s2", "s3", "s4", "s5"]
    edge = compare({"x": 0.5}, {"x": 0.75}, tolerance=0.25)
    assert edge.same == ["x"]  # exactly at the tolerance is not a change
    with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
        compare(a, b, tolerance=-0.1)
    with pytest.raises(ValueError, match=r"b\['s1'\] must be a finite number"):
        compare({"s1": 0.5}, {"s1": math.nan})
