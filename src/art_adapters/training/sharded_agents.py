"""Per-agent adapters (`art.PerAgent`) on the sharded trainer: the backend's side of it. The `PerAgent` rule (a
function, maybe) runs here: each step carries a table from each call's source to its adapter, and a resume the
agents to load; each process holds a `PerAgentTrainer` on its FSDP2 shards (every adapter's LoRA sharded with
its layer, each adapter's own AdamW over its own shards) and runs the one-process trainer's step.

Refusals happen here, before anything is sent: more adapters than the engine holds, SFT."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..agent_adapters import SHARED, PerAgent, UnsupportedPerAgentSetting
from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from .agent_steps import (
    SFT_REFUSED,
    Metrics,
    TableRoute,
    check_room,
    load_plan,
    log_first_seen,
    resumed_agents,
    route_table,
    split_views,
    tell_unlisted,
)
from .sharded import ShardedTrainer

log = logging.getLogger(__name__)


class ShardedPerAgentTrainer(ShardedTrainer):
    """A `ShardedTrainer` whose processes hold the shared adapter plus one per agent. `agents`: adapters to hold
    from the start besides a fixed list's (the backend passes the latest checkpoint's, so resuming it needs no
    rebuild: an agent first seen later makes every process build its model again, `PerAgentTrainer._regrow`).
    `max_adapters`: as `PerAgentTrainer`'s."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        per_agent: PerAgent,
        max_adapters: int | None = None,
        agents: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        initial = sorted(set(per_agent.listed()) | set(resumed_agents(agents, per_agent)))
        check_room(initial, 1, max_adapters)  # before any process starts
        self.per_agent = per_agent
        self.max_adapters = max_adapters
        self._held = initial
        self._told: set[str] = set()
        super().__init__(base_model, lora, adapters=initial, **kwargs)

    @property
    def agents(self) -> list[str]:
        """The agents' adapters the processes hold (not the shared one), sorted."""
        return list(self._held)

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, **more: Any) -> Metrics:
        """Route every call by the PerAgent rule, refuse an adapter that would not fit (nothing trained), then
        the processes' step: each adapter with calls takes one optimizer step on its own calls."""
        routes = route_table(self.per_agent, groups)
        views = split_views(groups, TableRoute(routes))
        new = sorted(set(views) - {SHARED} - set(self._held))
        check_room(new, len(self._held) + 1, self.max_adapters)
        tell_unlisted(self.per_agent, groups, self._told)
        log_first_seen(new, self.step + 1)
        return super().train_step(groups, config, routes=routes, **more)

    def sft_step(self, trajectories: list[Trajectory], config: SFTConfig) -> Metrics:
        raise UnsupportedPerAgentSetting(SFT_REFUSED)

    def load(self, directory: str | Path) -> None:
        """Resume the agents the checkpoint holds (`agent_steps.load_plan`: a fixed list loads only its own, and a
        warning names what changed), then the shared adapter, step and rng."""
        agents = load_plan(Path(directory), self.per_agent)
        check_room(sorted(set(agents) - set(self._held)), len(self._held) + 1, self.max_adapters)
        self._call("load", directory=str(directory), agents=agents)

    def adapter_logprobs(self, adapter: str, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """`logprobs_of` under one agent's adapter (SHARED: the shared one)."""
        if adapter != SHARED and adapter not in self._held:
            raise KeyError(f"the trainer holds no adapter for agent {adapter!r} (it holds {self._held})")
        answer = self._call(
            "adapter_logprobs", adapter=adapter, token_ids=list(token_ids), temperature=temperature
        )
        return answer["logprobs"]

    def _heard(self, answer: dict[str, Any]) -> None:
        self._held = sorted(answer.get("agents", self._held))
