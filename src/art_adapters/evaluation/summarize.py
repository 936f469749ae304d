"""From finished attempts to statistics: each target's summary and the paired comparisons between targets (the
numbers come from stats.py; this module decides what they are computed over).

- Reward: each scenario's mean over its finished attempts, then the bootstrap interval over scenarios. An errored
  attempt has no reward; it is counted in `errors` and never averaged in as a zero.
- Success: `reward >= success_threshold`, or, without a threshold, a reward that is always 0 or 1 is a boolean
  success. Unknown otherwise (success_rate None, no pass@k).
- pass@k: per scenario over all its attempts (an errored attempt counts as a failure), averaged over scenarios.
- A comparison pairs the scenarios both targets finished: diff = b - a per scenario, paired bootstrap interval;
  the scenarios one target finished no attempt of are named in its `unpaired`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from .intervals import Changes, Interval
from .results import Attempt, Comparison, TargetSummary
from .stats import compare, mean_ci, paired_diff_ci, pass_at_k

NO_VALUE = Interval(math.nan, math.nan, math.nan)


def mark_success(attempts: list[Attempt], threshold: float | None) -> bool:
    """Set each finished attempt's `success`; returns whether success is known for this evaluation."""
    finished = [a for a in attempts if a.error is None and a.reward is not None]
    if threshold is None and not all(a.reward in (0.0, 1.0) for a in finished):
        for attempt in attempts:
            attempt.success = None
        return False
    for attempt in attempts:
        if attempt.error is not None or attempt.reward is None:
            attempt.success = None
        else:
            attempt.success = attempt.reward >= threshold if threshold is not None else attempt.reward == 1.0
    return True


def scenario_means(attempts: list[Attempt], target: str) -> dict[str, float]:
    """Scenario id -> mean reward over the target's finished attempts (scenarios with none are absent)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for attempt in attempts:
        if attempt.target == target and attempt.error is None and attempt.reward is not None:
            rewards[attempt.scenario_id].append(attempt.reward)
    return {sid: math.fsum(values) / len(values) for sid, values in rewards.items()}


def summarize_target(
    attempts: list[Attempt],
    label: str,
    step: int | None,
    scenario_ids: list[str],
    pass_ks: Sequence[int],
    success_known: bool,
) -> TargetSummary:
    mine = [a for a in attempts if a.target == label]
    means = scenario_means(mine, label)
    ordered = [means[sid] for sid in scenario_ids if sid in means]
    reward = mean_ci(ordered) if ordered else NO_VALUE
    success_rate: float | None = None
    passes: dict[int, float] = {}
    if success_known:
        by_scenario: dict[str, list[Attempt]] = defaultdict(list)
        for attempt in mine:
            by_scenario[attempt.scenario_id].append(attempt)
        rates = []
        for sid in scenario_ids:
            done = [a for a in by_scenario.get(sid, []) if a.error is None]
            if done:
                rates.append(sum(bool(a.success) for a in done) / len(done))
        success_rate = math.fsum(rates) / len(rates) if rates else None
        for k in pass_ks:
            values = []
            for sid in scenario_ids:
                tries = by_scenario.get(sid, [])
                if len(tries) >= k:
                    values.append(pass_at_k(len(tries), sum(bool(a.success) for a in tries), k))
            if values:
                passes[k] = math.fsum(values) / len(values)
    return TargetSummary(
        target=label,
        step=step,
        scenarios=len(ordered),
        errors=sum(1 for a in mine if a.error is not None),
        reward=reward,
        success_rate=success_rate,
        pass_at_k=passes,
    )


def comparison(attempts: list[Attempt], a: str, b: str, scenario_ids: list[str]) -> Comparison:
    """b against a, paired over the scenarios both finished."""
    before, after = scenario_means(attempts, a), scenario_means(attempts, b)
    both = [sid for sid in scenario_ids if sid in before and sid in after]
    unpaired = [sid for sid in scenario_ids if sid not in both]  # named, never silently left out of the gain
    if not both:
        return Comparison(a, b, NO_VALUE, Changes(), unpaired)
    diff = paired_diff_ci([before[s] for s in both], [after[s] for s in both])
    changes = compare({s: before[s] for s in both}, {s: after[s] for s in both})
    return Comparison(a, b, diff, changes, unpaired)


def default_pairs(step_labels: list[str], reference_labels: list[str]) -> list[tuple[str, str]]:
    """Every later step against the first step named (step 0 by default: did training help?), then the newest step
    against each reference (diff = newest step - reference: positive when the trained model beats it)."""
    pairs = [(step_labels[0], later) for later in step_labels[1:]]
    if step_labels:
        pairs += [(reference, step_labels[-1]) for reference in reference_labels]
    return pairs
