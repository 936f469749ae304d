"""A pipeline step's metrics: ART's current names (`discarded/...`, `time/...`, `offpolicy/...`, `queue/...`,
`sample_efficiency/...`) beside the older ones (`steps_off_policy`, `discarded_stale_groups`, ...)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..trajectories import TrajectoryGroup
from .state import PipelineState
from .versions import group_version, token_weighted_ages, weighted_percentile

FRESHNESS_TAU_STEPS = 8.0  # ART's freshness discount: exp(-age / 8) per token


@dataclass
class StepTiming:
    """Where one step's wall time went (seconds)."""

    wall_s: float  # from the start of collecting its batch to its log
    collect_s: float  # the trainer waiting for groups (idle)
    train_s: float  # the backend's step
    rollout_s: float  # the batch's rollouts, summed
    rollout_idle_s: float  # rollout workers waiting (staleness gate or a full queue) since the last step
    queue_wait_s: float  # of which waiting for room in the queue


def step_metrics(
    batch: Sequence[TrajectoryGroup],
    names: set[str],
    step_from: int,
    state: PipelineState,
    discarded_stale: int,
    discarded_zero_variance: int,
    timing: StepTiming,
    queued: Sequence[TrajectoryGroup],
    queue_cap: int,
    max_steps_off_policy: int,
) -> dict[str, float]:
    """Metrics of a step trained from version `step_from` on `batch` (`queued`: the groups still waiting)."""
    off = [step_from - group_version(g, step_from) for g in batch]
    generated = state.accepted_trainable_groups + state.discarded_stale_groups
    generated += state.discarded_zero_variance_groups
    metrics: dict[str, float] = {
        # the older names
        "steps_off_policy": sum(off) / len(off),
        "max_steps_off_policy": float(max(off)),
        "discarded_stale_groups": float(state.discarded_stale_groups),
        "zero_variance_groups": float(state.discarded_zero_variance_groups),
        "rollout_errors": float(state.rollout_errors),
        "time/step_trainer_s": timing.train_s,
        "throughput/step_trainer_idle_s": timing.collect_s,
        "throughput/step_actor_idle_s": timing.rollout_idle_s,
        # ART's current names
        "discarded/cum/stale_groups": float(state.discarded_stale_groups),
        "discarded/cum/zero_variance_groups": float(state.discarded_zero_variance_groups),
        "discarded/step/stale_groups": float(discarded_stale),
        "discarded/step/zero_variance_groups": float(discarded_zero_variance),
        "discarded/rate/stale_groups": state.discarded_stale_groups / max(generated, 1),
        "discarded/rate/zero_variance_groups": state.discarded_zero_variance_groups / max(generated, 1),
        "time/step_wall_s": timing.wall_s,
        "time/step_collect_batch_s": timing.collect_s,
        "time/step_trainer_idle_s": timing.collect_s,
        "time/step_backend_train_s": timing.train_s,
        "time/step_rollout_s": timing.rollout_s,
        "time/step_rollout_idle_s": timing.rollout_idle_s,
        "sample_efficiency/accepted_groups_per_step": float(len(batch)),
        "sample_efficiency/batch_factor": 1.0,
    }
    if timing.rollout_s > 0:
        metrics["queue/put_wait_frac"] = timing.queue_wait_s / timing.rollout_s
    ages = token_weighted_ages(batch, names, step_from)
    if ages:
        weight = sum(w for _, w in ages)
        metrics["offpolicy/token_weighted_policy_age_steps"] = sum(a * w for a, w in ages) / weight
        metrics["offpolicy/token_weighted_policy_age_p95_steps"] = weighted_percentile(ages, 0.95)
        moment = sum(math.exp(max(a, 0.0) / FRESHNESS_TAU_STEPS) * w for a, w in ages) / weight
        metrics["sample_efficiency/freshness_discount"] = 1.0 / moment
    metrics.update(queue_metrics(queued, queue_cap, step_from + 1, max_steps_off_policy))
    return metrics


def queue_metrics(
    queued: Sequence[TrajectoryGroup], cap: int, step: int, max_steps_off_policy: int
) -> dict[str, float]:
    """How full the queue of finished groups is and how old they will be when the next step (`step`) takes them."""
    ages = [float(step - group_version(g, step)) for g in queued]
    limit = max(float(max_steps_off_policy), 1e-9)
    mean = sum(ages) / len(ages) if ages else 0.0
    return {
        "queue/groups_depth": float(len(queued)),
        "queue/groups_depth_max": float(cap),
        "queue/occupancy": len(queued) / max(cap, 1),
        "queue/predicted_policy_age_mean_steps": mean,
        "queue/predicted_policy_age_p95_steps": weighted_percentile([(a, 1.0) for a in ages], 0.95),
        "queue/freshness_pressure": mean / limit if ages else 0.0,
        "queue/predicted_stale_fraction": sum(a > max_steps_off_policy for a in ages) / len(ages)
        if ages
        else 0.0,
    }
