"""Which trainer a LocalBackend model gets: one process or sharded (FSDP2), one adapter or one per agent, with the
plan's settings and the engine's sequence length. Loading its checkpoint is the caller's (backend/trainers.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model import TrainableModel
from .placement import trainer_settings

if TYPE_CHECKING:
    from ..config import ShardedTrainerOptions
    from ..gpu_plan import Plan
    from ..training.sharded import ShardedTrainer
    from ..training.trainer import Trainer


def new_trainer(
    model: TrainableModel,
    *,
    processes: int,
    gpus: list[int],
    plan: Plan | None,
    max_seq_len: int | None,
    adapter_room: int | None,
    latest_agents: list[str],
    nodes: int,
    master: str | None,
    options: ShardedTrainerOptions | None,
) -> Trainer | ShardedTrainer:
    """A fresh trainer for `model`. `max_seq_len`: the engine's max_model_len, so both cut sequences alike;
    `adapter_room`: how many adapters the engine holds (per-agent); `latest_agents`: the agents the latest
    checkpoint holds (the sharded per-agent trainer starts with them, so resuming needs no rebuild)."""

    def settings_for(trainer_class: type) -> dict[str, Any]:
        settings = trainer_settings(plan, trainer_class)
        if max_seq_len is not None:
            settings["max_seq_len"] = max_seq_len
        return settings

    if processes > 1 or nodes > 1:
        from ..training.sharded import ShardedTrainer

        settings = settings_for(ShardedTrainer)
        sharded = ShardedTrainer
        if model.adapters is not None:  # one adapter per agent, each sharded (FSDP2) with its layers
            from ..training.sharded_agents import ShardedPerAgentTrainer

            sharded = ShardedPerAgentTrainer
            settings.update(per_agent=model.adapters, max_adapters=adapter_room, agents=latest_agents)
        return sharded(
            model.base_model,
            model.lora,
            processes=processes,
            gpu_ids=gpus or None,
            nodes=nodes,
            master=master,
            options=options,
            **settings,
        )
    from ..training.trainer import Trainer

    settings = settings_for(Trainer)
    device = f"cuda:{gpus[0]}" if gpus else None
    if model.adapters is not None:  # one adapter per agent on the one base (PEFT)
        from ..training.per_agent import PerAgentTrainer

        settings.pop("engine", None)
        return PerAgentTrainer(
            model.base_model,
            model.lora,
            per_agent=model.adapters,
            max_adapters=adapter_room,
            device=device,
            **settings,
        )
    return Trainer(model.base_model, model.lora, device=device, **settings)
