"""What a per-agent step decides before and after any weight moves, shared by the one-process trainer
(`per_agent.py`) and the sharded one (`sharded_agents.py`, whose processes cannot run a `PerAgent(by=function)`):
each call's adapter, each adapter's view of the groups (AT-GRPO), the room for a new adapter, which agents a
checkpoint resumes, and the step's combined metrics. Torch-free."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..agent_adapters import AGENT_METRICS, SHARED, PerAgent, UnsupportedPerAgentSetting
from ..checkpoints import checkpoint_agents
from ..sources import CallSource
from ..trajectories import TrajectoryGroup

log = logging.getLogger("art_adapters.training.per_agent")
Metrics = dict[str, Any]
Route = Callable[[CallSource | None], str]  # a call's source -> the adapter it trains (SHARED: "")
PEFT_SHARED = "default"  # PEFT's name of the shared adapter (the model's own, served as `{project}/{name}`)
SFT_REFUSED = (
    "train_sft with adapters=PerAgent(...) is not supported yet: it would train only the shared adapter (the "
    "agents' adapters start fresh); warm-start without PerAgent, or train with RL steps"
)


def peft_name(adapter: str) -> str:
    return PEFT_SHARED if adapter == SHARED else f"agent_{adapter}"


def metric_name(adapter: str) -> str:
    return "shared" if adapter == SHARED else adapter


# --- routing: a table the trainer's processes can apply -------------------------------------------------------


def source_key(source: CallSource) -> str:
    """A source's canonical JSON: equal for equal sources, on either side of the wire."""
    return json.dumps(source.model_dump(mode="json"), sort_keys=True)


def route_table(per_agent: PerAgent, groups: Iterable[TrajectoryGroup]) -> dict[str, str]:
    """Every distinct source of the groups' calls -> its adapter (`PerAgent.adapter_of` is a function of the
    source alone, so the table routes exactly as the rule does, `by=function` included). Every call the trainer
    samples from: the trajectories' and their additional histories' (a trace read back may list calls there
    only)."""
    return {
        source_key(call.source): per_agent.adapter_of(call.source)
        for group in groups
        for trajectory in group.trajectories
        for history in (trajectory, *trajectory.additional_histories)
        for call in history.llm_calls
        if call.source is not None
    }


class TableRoute:
    """`route_table`'s answer as a Route; a source missing from it is a bug on the sending side (KeyError)."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = dict(table)

    def __call__(self, source: CallSource | None) -> str:
        return SHARED if source is None else self.table[source_key(source)]


# --- one step's views ----------------------------------------------------------------------------------------


def split_views(groups: list[TrajectoryGroup], route: Route) -> dict[str, list[TrajectoryGroup]]:
    """Each adapter's view of the groups: per group, the trajectories with a call of its agent (a trajectory with
    no captured call belongs to the shared adapter). Views share the caller's trajectories, not its lists."""
    views: dict[str, list[TrajectoryGroup]] = {}
    for group in groups:
        members: dict[str, list[Any]] = {}
        for trajectory in group.trajectories:
            adapters = {route(c.source) for c in trajectory.llm_calls} or {SHARED}
            for adapter in adapters:
                members.setdefault(adapter, []).append(trajectory)
        for adapter, trajectories in members.items():
            view = copy.copy(group)  # its own list: the caller's group keeps every trajectory
            view.trajectories = trajectories
            views.setdefault(adapter, []).append(view)
    return views


def check_room(new: list[str], held: int, max_adapters: int | None) -> None:
    """Refuse, with the numbers, the first of `new` adapters that would not fit beside `held` (shared included)."""
    if max_adapters is None:
        return
    for count, adapter in enumerate(new, start=held + 1):
        if count > max_adapters:
            raise UnsupportedPerAgentSetting(
                f"agent {adapter!r} would be adapter {count} (shared + {count - 1} agents), but the engine serves "
                f"at most {max_adapters} at once (max_loras less one loading): raise InferenceConfig.max_loras, "
                "or list fewer agents in PerAgent(agents=...)"
            )


def log_first_seen(adapters: Iterable[str], step: int) -> None:
    for adapter in adapters:
        log.info("per-agent adapters: agent %r first seen at step %d; a fresh adapter", adapter, step)


def tell_unlisted(per_agent: PerAgent, groups: Iterable[TrajectoryGroup], told: set[str]) -> None:
    """Once per key (`told` remembers): an agent not in a fixed `agents` list trains the shared adapter."""
    if per_agent.agents is None:
        return
    keys = {
        key
        for g in groups
        for t in g.trajectories
        for c in t.llm_calls
        if (key := per_agent.key_of(c.source)) is not None
    }
    for key in sorted(keys - set(per_agent.agents) - told):
        told.add(key)
        log.info(
            "per-agent adapters: %r is not in PerAgent(agents=...); its calls train the shared adapter", key
        )


# --- resume ------------------------------------------------------------------------------------------------


def resumed_agents(on_disk: Iterable[str], per_agent: PerAgent) -> list[str]:
    """The agents a checkpoint holding `on_disk` resumes: all of them, or with a fixed list only those listed."""
    on_disk = set(on_disk)
    return sorted(on_disk if per_agent.agents is None else on_disk & set(per_agent.listed()))


def load_plan(directory: Path, per_agent: PerAgent) -> list[str]:
    """The agents to load from a checkpoint (`resumed_agents`); a warning names those not loaded and the listed
    ones that start fresh (none on disk at all: a single-adapter run's checkpoint, quietly)."""
    on_disk = set(checkpoint_agents(directory))
    loading = resumed_agents(on_disk, per_agent)
    listed = set(per_agent.listed()) if per_agent.agents is not None else None
    dropped, fresh = sorted(on_disk - set(loading)), sorted((listed or set()) - on_disk)
    if dropped or fresh:
        log.warning(
            "checkpoint %s holds agents %s; this run's PerAgent(agents=...) lists %s: %s%s",
            directory,
            sorted(on_disk),
            sorted(listed or []),
            f"not loaded (their calls train the shared adapter; later checkpoints will not hold them): {dropped}"
            if dropped
            else "",
            f"{'; ' if dropped else ''}fresh adapters: {fresh}" if fresh else "",
        )
    return loading


# --- the step's metrics ----------------------------------------------------------------------------------------


def combined_metrics(
    results: dict[str, Metrics], groups: list[TrajectoryGroup], started: float, step: int
) -> Metrics:
    """The step's metrics: one adapter's own when one trained (the single-adapter numbers), else sums (tokens,
    loss: the adapters' objectives are independent), the norm of all gradients, and per agent
    `agent/{name}/{loss,trained_tokens,grad_norm,reward_mean,trajectories}`."""
    trained = {a: m for a, m in results.items() if "skipped_reason" not in m}
    if len(results) == 1:
        metrics = dict(next(iter(results.values())))
    else:
        rewards = [t.reward for g in groups for t in g.trajectories]
        metrics = {
            "loss": sum(m.get("loss", 0.0) for m in trained.values()),
            "trained_tokens": sum(m.get("trained_tokens", 0) for m in results.values()),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "groups": len(groups),
            "trajectories": len(rewards),
            "sequences": sum(m.get("sequences", 0) for m in trained.values()),
            "step": step,
        }
        if trained:
            norms = [m["grad_norm"] for m in trained.values()]
            metrics["grad_norm"] = math.sqrt(sum(n * n for n in norms))
            metrics["learning_rate"] = next(iter(trained.values()))["learning_rate"]
            fractions = [m["sampled_token_fraction"] for m in trained.values()]
            metrics["sampled_token_fraction"] = min(fractions)
            metrics.update(_staleness(list(trained.values())))
            first = next(iter(trained.values()))
            if "trainer_processes" in first:  # the sharded trainer's
                metrics["trainer_processes"] = first["trainer_processes"]
        else:
            metrics["skipped_reason"] = "; ".join(
                f"{metric_name(a)}: {m['skipped_reason']}" for a, m in sorted(results.items())
            )
        metrics["step_seconds"] = time.perf_counter() - started
    metrics["adapters_trained"] = len(trained)
    for adapter, m in results.items():
        for key in AGENT_METRICS:
            if key in m:
                metrics[f"agent/{metric_name(adapter)}/{key}"] = m[key]
    return metrics


def _staleness(trained: list[Metrics]) -> Metrics:
    """The step's staleness over every trained adapter's tokens: stale tokens summed, steps off policy per token
    (the mean weighted by each adapter's trained tokens), the largest stale drop."""
    tokens = sum(m.get("trained_tokens", 0) for m in trained)
    off = sum(m.get("token_steps_off_policy", 0.0) * m.get("trained_tokens", 0) for m in trained)
    return {
        "stale_tokens": sum(int(m.get("stale_tokens", 0)) for m in trained),
        "token_steps_off_policy": off / tokens if tokens else 0.0,
        "max_stale_drop": max(float(m.get("max_stale_drop", 0.0)) for m in trained),
    }
