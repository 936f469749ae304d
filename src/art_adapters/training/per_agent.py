"""One trainer, one base, one LoRA adapter per agent (`art.PerAgent`): PEFT multi-adapter, each adapter with its own
AdamW state; one step updates every adapter that has calls, on its own calls only; the step advances once. In one
process, or as each process of the sharded trainer (FSDP2: every adapter's LoRA sharded with its layer).

AT-GRPO's grouping: an adapter's view of a group holds only the trajectories in which its agent made a call, so
its baseline is over those; within them, only its own calls' sampled tokens train (the other agents' turns stay
in the sequences as context, as `train_on` leaves them). Per-role rewards and `train_on` apply unchanged. Each new
adapter starts from the same initial weights as the shared one (seeded: lora_A drawn, lora_B = 0, so it serves
the base policy), which makes one agent's run train bit-for-bit like a single adapter.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..agent_adapters import SHARED, PerAgent, UnsupportedPerAgentSetting
from ..checkpoints import agent_checkpoint_dir, checkpoint_agents
from ..config import LoRAConfig, TrainConfig
from ..trajectories import TrajectoryGroup
from . import adapter_io, loading, shard_io
from .agent_steps import (
    AGENT_METRICS,
    PEFT_SHARED,
    SFT_REFUSED,
    Route,
    check_room,
    combined_metrics,
    load_plan,
    log_first_seen,
    metric_name,
    peft_name,
    split_views,
    tell_unlisted,
)
from .parallel import AgreedError, agree
from .prepare import prepare_groups
from .tokenize import TrainSequence
from .trainer import Metrics, Trainer, default_engine
from .trainer_parts import _moved
from .versions import check_not_future

log = logging.getLogger(__name__)
__all__ = ["AGENT_METRICS", "PEFT_SHARED", "PerAgentTrainer", "Slot", "metric_name", "peft_name"]


@dataclass
class Slot:
    """One adapter in the trainer: its PEFT name, its parameters (module order) and its own optimizer."""

    peft: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


class PerAgentTrainer(Trainer):
    """A Trainer holding the shared adapter plus one per agent (see the module docstring). PEFT only: Unsloth's
    patched single-adapter path is not used (asking for it is refused).

    `per_agent`: the rule routing each call to its adapter. None inside a sharded trainer's process, which is
    sent each step's routes (`route`) and the agents to load by the backend's side (`sharded_agents.py`).
    `adapters`: agents' adapters to hold from the start (besides a fixed list's). `max_adapters`: how many
    adapters (the shared one included) may exist, what the engine can serve at once; an agent beyond it is
    refused with the numbers before anything loads or trains. `scratch`: where a sharded process's rank 0 writes
    the temporary checkpoint of a rebuild (`_regrow`; the backend's private folder, removed with the trainer even
    when a process dies mid-rebuild; None: the temporary directory)."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        per_agent: PerAgent | None,
        max_adapters: int | None = None,
        adapters: Sequence[str] = (),
        engine: str = "auto",
        scratch: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        if engine == "unsloth" or kwargs.get("load_in_4bit"):
            raise UnsupportedPerAgentSetting(
                "adapters=PerAgent(...) trains with PEFT + transformers: Unsloth (and its 4-bit base) is not "
                "used for several adapters on one base; leave engine='auto' and load_in_4bit=False"
            )
        if engine == "auto" and default_engine() == "unsloth":
            log.info("per-agent adapters: training with PEFT + transformers (not Unsloth)")
        if scratch is not None and kwargs.get("parallel") is None:
            raise ValueError(
                "scratch is where a sharded process rebuilds (parallel=...); one process never does"
            )
        initial = sorted(set(per_agent.listed() if per_agent is not None else ()) | set(adapters))
        check_room(initial, 1, max_adapters)  # before anything loads
        self._initial = initial
        self.scratch = None if scratch is None else Path(scratch)
        super().__init__(base_model, lora, engine="peft", **kwargs)
        self.per_agent = per_agent
        self.route: Route = per_agent.adapter_of if per_agent is not None else _shared_only
        self.max_adapters = max_adapters
        self.active = SHARED
        self._selected: str | None = None
        self._told: set[str] = set()
        if self.parallel is not None:  # every adapter was built into the sharded model
            self._sharded_slots(initial)
            return
        self._fresh = {  # the seeded initial adapter: every agent's adapter starts from it
            name: p.detach().clone()
            for name, p in self.model.named_parameters()
            if p.requires_grad and f".{PEFT_SHARED}." in name
        }
        self.slots: dict[str, Slot] = {SHARED: Slot(PEFT_SHARED, self.params, self.optimizer)}
        self.add_adapters(initial)

    # --- adapters ----------------------------------------------------------------------------------------

    @property
    def agents(self) -> list[str]:
        """The agents' adapters this trainer holds (not the shared one), sorted."""
        return sorted(a for a in self.slots if a != SHARED)

    def add_adapter(self, adapter: str) -> None:
        """A fresh adapter for `adapter` (the seeded initial weights, its own AdamW); a no-op if held."""
        self.add_adapters([adapter])

    def add_adapters(self, adapters: Iterable[str]) -> None:
        """Fresh adapters for those of `adapters` not held (refused with the numbers when they do not fit)."""
        new = sorted(set(adapters) - set(self.slots))
        if not new:
            return
        check_room(new, len(self.slots), self.max_adapters)
        if self.parallel is not None:
            self._regrow(new)
            return
        for adapter in new:
            self._add_one(adapter)
        self.use(self.active)

    def _add_one(self, adapter: str) -> None:
        name = peft_name(adapter)
        self.model.add_adapter(name, loading.peft_config(self.lora))
        named = dict(self.model.named_parameters())
        params = []
        with torch.no_grad():
            for key, fresh in self._fresh.items():
                target = named[key.replace(f".{PEFT_SHARED}.", f".{name}.")]
                target.copy_(fresh.to(target.device, target.dtype))
                params.append(target)
        owned = [n for n in named if f".{name}." in n]
        if len(owned) != len(params):
            raise RuntimeError(f"adapter {name}: {len(owned)} parameters, {len(params)} initialised")
        fused = self.device.type == "cuda"
        self.slots[adapter] = Slot(name, params, torch.optim.AdamW(params, lr=1e-5, fused=fused))

    def use(self, adapter: str) -> None:
        """Make `adapter` the active one: its LoRA in every forward, its parameters trainable, its optimizer."""
        slot = self.slots[adapter]
        self.model.set_adapter(slot.peft)  # PEFT: only the active adapter requires grad
        self.params, self.optimizer, self.active = slot.params, slot.optimizer, adapter

    @torch.no_grad()
    def adapter_logprobs(self, adapter: str, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """`logprobs_of` under one agent's adapter (SHARED: the shared one)."""
        previous = self.active
        self.use(adapter)
        try:
            return self.logprobs_of(token_ids, temperature)
        finally:
            self.use(previous)

    def state_bytes(self) -> dict[str, dict[str, int]]:
        """Per adapter (metric name): the bytes of its weights and AdamW state this process holds (`held`: its
        shards when sharded) and their whole size (`whole`): the memory an adapter adds to each process."""
        out = {}
        for adapter, slot in self.slots.items():
            tensors = [*slot.params]
            for state in slot.optimizer.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
            held = sum(_local(t).numel() * t.element_size() for t in tensors)
            out[metric_name(adapter)] = {
                "held": held,
                "whole": sum(t.numel() * t.element_size() for t in tensors),
            }
        return out

    # --- sharded: every adapter is in the model when FSDP2 wraps it -------------------------------------------

    def _sharded_adapters(self) -> list[str]:
        return [peft_name(a) for a in self._initial]

    def _sharded_slots(self, agents: Iterable[str]) -> None:
        """A slot per adapter of the sharded model (the shared one and `agents`): its DTensor parameters in
        module order (the order one process's slots have, so checkpoints match), its own AdamW."""
        named = list(self.model.named_parameters())
        self.slots = {}
        for adapter in [SHARED, *sorted(agents)]:
            name = peft_name(adapter)
            params = [p for n, p in named if f".{name}." in n]
            self.slots[adapter] = Slot(name, params, torch.optim.AdamW(params, lr=1e-5, fused=False))
        self.use(SHARED)

    def _regrow(self, new: list[str]) -> None:
        """FSDP2 shards a module's parameters once, when it wraps them: an adapter added afterwards would be a
        plain tensor on each process that no reduce-scatter syncs. So the model is built again holding every
        adapter (the base read and scattered by rank 0, as at start-up), and the held adapters' state (weights,
        AdamW moments, step, rng) goes through a checkpoint rank 0 writes to a new folder in `scratch`. A
        failure to make or write it is agreed (nothing changed); one past it ends the processes (the backend
        resumes from the last checkpoint, and removes `scratch` with what a killed rank 0 left there)."""
        assert self.parallel is not None
        held = self.agents
        leader = self.parallel.leader
        folder, error = Path("art-trainer-grow"), None  # only rank 0 writes or reads it
        if leader:
            try:
                folder = Path(tempfile.mkdtemp(prefix="art-trainer-grow-", dir=self.scratch))
            except OSError as failure:  # a full disk: every process raises it, none aborts
                error = failure
        agree(self.parallel, error, group=self.parallel.bounded)
        try:
            self.save(folder)
            for name in ("model", "scorer", "optimizer", "params", "slots"):
                self.__dict__.pop(name, None)
            probe = self.__dict__.pop("_weight_probe", None)
            if probe is not None:
                probe.remove()
            self._measured = []
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._build_sharded([peft_name(a) for a in sorted([*held, *new])])
            self._sharded_slots([*held, *new])
            if probe is not None:  # a memory probe that was on follows the new model, its peak so far kept
                from .fsdp import WeightProbe

                self._weight_probe = WeightProbe(self.scorer, self.model)
                self._weight_probe.peak = probe.peak
            try:
                self.load_agents(folder, held)
            except AgreedError as error:  # answered, the processes would go on with fresh adapters: end them
                raise RuntimeError(f"the rebuilt model could not take back its adapters: {error}") from error
        finally:
            if leader:
                shutil.rmtree(folder, ignore_errors=True)
        log.info(
            "per-agent adapters: the sharded model rebuilt with %d agents' adapters", len(held) + len(new)
        )

    # --- one step ----------------------------------------------------------------------------------------

    def split(self, groups: list[TrajectoryGroup]) -> dict[str, list[TrajectoryGroup]]:
        """Each adapter's view of the groups (`agent_steps.split_views`). Adapters first seen here are added
        (logged where the rule lives)."""
        views = split_views(groups, self.route)
        if self.per_agent is not None:
            tell_unlisted(self.per_agent, groups, self._told)
        new = sorted(set(views) - set(self.slots))
        self.add_adapters(new)
        if self.per_agent is not None:
            log_first_seen(new, self.step + 1)
        return views

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> Metrics:
        """One optimizer step for each adapter with calls in `groups`; the step counter advances once."""
        started = time.perf_counter()
        views = self.split(groups) or {SHARED: groups}
        step, moved = self.step, False
        results: dict[str, Metrics] = {}
        try:
            for adapter in sorted(views):  # the shared adapter ("") first
                self.use(adapter)
                self._selected, self.step = adapter, step
                results[adapter] = Trainer.train_step(self, views[adapter], config)
                moved = moved or "skipped_reason" not in results[adapter]
        except BaseException:
            self.step = step + 1 if moved else step  # weights moved: the caller reloads from disk
            raise
        finally:
            self._selected = None
            self.use(SHARED)
        self.step = step + 1
        return combined_metrics(results, groups, started, self.step)

    def prepare(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> tuple[list[TrainSequence], Metrics]:
        """The Trainer's, keeping only the selected adapter's calls trainable."""
        limit = self.seq_limit(config.max_seq_len)
        selected, route = self._selected, self.route
        select = None if selected is None else (lambda s: route(s) == selected)
        sequences, metrics = prepare_groups(
            self.tokenizer, self.vocab_size, groups, config, max_seq_len=limit, select=select
        )
        check_not_future(groups, (v for s in sequences for v in s.versions), self.step)
        return sequences, metrics

    def sft_step(self, trajectories: list[Any], config: Any) -> Metrics:
        """Refused: SFT would train the shared adapter only, and the agents' adapters start fresh, not from it."""
        raise UnsupportedPerAgentSetting(SFT_REFUSED)

    # --- state -------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """The shared adapter's files at `directory` (as a single-adapter trainer writes them), each agent's under
        `directory/agents/{adapter}/` (adapter, optimizer and trainer state); sharded: the same files, each
        adapter gathered whole by every process and written by rank 0."""
        directory = Path(directory)
        try:
            for adapter in self.agents:
                self.use(adapter)
                folder, peft = agent_checkpoint_dir(directory, adapter), self.slots[adapter].peft
                if self.parallel is not None:
                    shard_io.save_sharded(self, folder, peft)
                else:
                    adapter_io.save_trainer(self, folder, peft)
        finally:
            self.use(SHARED)
        return Trainer.save(self, directory)

    def load(self, directory: str | Path) -> None:
        """Resume every adapter the checkpoint holds (a fixed `agents` list: only those; the others are named in
        a warning and not loaded), then the shared one (its step and rng win). Listed agents the checkpoint lacks
        start fresh; the warning says which changed."""
        directory = Path(directory)
        plan = load_plan(directory, self.per_agent) if self.per_agent is not None else None
        self.load_agents(directory, checkpoint_agents(directory) if plan is None else plan)

    def load_agents(self, directory: str | Path, agents: Sequence[str]) -> None:
        """Load `agents`' adapters from the checkpoint at `directory` (added first when not held), then the
        shared adapter with the step and rng. A sharded process is told `agents` (only rank 0 reads the disk)."""
        directory = Path(directory)
        self.add_adapters(agents)
        try:
            for adapter in sorted(agents):
                self.use(adapter)
                folder = agent_checkpoint_dir(directory, adapter)
                if self.parallel is not None:
                    shard_io.load_sharded(self, folder)
                else:
                    adapter_io.load_trainer(self, folder)
        finally:
            self.use(SHARED)
        Trainer.load(self, directory)

    def _move_state(self, device: torch.device) -> None:
        """Offload/reload (CUDA, shared GPU): the weights once, then every adapter's optimizer state."""
        pin = device.type == "cpu" and torch.cuda.is_available()
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.data = _moved(tensor.data, device, pin)
                tensor.grad = None
            for slot in self.slots.values():
                for state in slot.optimizer.state.values():
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            state[key] = _moved(value, device, pin)

    def close(self) -> None:
        self.__dict__.pop("slots", None)
        self.__dict__.pop("_fresh", None)
        super().close()


def _shared_only(source: Any) -> str:
    return SHARED


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this process's shard
