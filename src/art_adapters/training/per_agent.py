"""One trainer, one base, one LoRA adapter per agent (`art.PerAgent`): PEFT multi-adapter, each adapter with its own
AdamW state; one step updates every adapter that has calls, on its own calls only; the step advances once.

AT-GRPO's grouping: an adapter's view of a group holds only the trajectories in which its agent made a call, so
its baseline is over those; within them, only its own calls' sampled tokens train (the other agents' turns stay
in the sequences as context, as `train_on` leaves them). Per-role rewards and `train_on` apply unchanged. Each new
adapter starts from the same initial weights as the shared one (seeded: lora_A drawn, lora_B = 0, so it serves
the base policy), which makes one agent's run train bit-for-bit like a single adapter.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..agent_adapters import AGENT_METRICS, SHARED, PerAgent, UnsupportedPerAgentSetting
from ..checkpoints import agent_checkpoint_dir, checkpoint_agents
from ..config import LoRAConfig, TrainConfig
from ..trajectories import TrajectoryGroup
from . import adapter_io, loading
from .prepare import prepare_groups
from .tokenize import TrainSequence
from .trainer import Metrics, Trainer, default_engine
from .trainer_parts import _moved
from .versions import check_not_future

log = logging.getLogger(__name__)
PEFT_SHARED = "default"  # PEFT's name of the shared adapter (the model's own, served as `{project}/{name}`)


@dataclass
class Slot:
    """One adapter in the trainer: its PEFT name, its parameters (module order) and its own optimizer."""

    peft: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


def peft_name(adapter: str) -> str:
    return PEFT_SHARED if adapter == SHARED else f"agent_{adapter}"


def metric_name(adapter: str) -> str:
    return "shared" if adapter == SHARED else adapter


class PerAgentTrainer(Trainer):
    """A Trainer holding the shared adapter plus one per agent (see the module docstring). PEFT only: Unsloth's
    patched single-adapter path is not used (asking for it is refused); the sharded trainer is refused.

    `max_adapters`: how many adapters (the shared one included) may exist, what the engine can serve at once; an
    agent beyond it is refused with the numbers before its step trains anything."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        per_agent: PerAgent,
        max_adapters: int | None = None,
        engine: str = "auto",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("parallel") is not None:
            raise UnsupportedPerAgentSetting(
                "adapters=PerAgent(...) is not supported by the sharded trainer (trainer_processes > 1 or several "
                "trainer GPUs/nodes) yet: train per-agent adapters in one process"
            )
        if engine == "unsloth" or kwargs.get("load_in_4bit"):
            raise UnsupportedPerAgentSetting(
                "adapters=PerAgent(...) trains with PEFT + transformers: Unsloth (and its 4-bit base) is not "
                "used for several adapters on one base; leave engine='auto' and load_in_4bit=False"
            )
        if engine == "auto" and default_engine() == "unsloth":
            log.info("per-agent adapters: training with PEFT + transformers (not Unsloth)")
        super().__init__(base_model, lora, engine="peft", **kwargs)
        self.per_agent = per_agent
        self.max_adapters = max_adapters
        self._fresh = {  # the seeded initial adapter: every agent's adapter starts from it
            name: p.detach().clone()
            for name, p in self.model.named_parameters()
            if p.requires_grad and f".{PEFT_SHARED}." in name
        }
        self.slots: dict[str, Slot] = {SHARED: Slot(PEFT_SHARED, self.params, self.optimizer)}
        self.active = SHARED
        self._selected: str | None = None
        self._told: set[str] = set()
        for adapter in per_agent.listed():
            self.add_adapter(adapter)

    # --- adapters ----------------------------------------------------------------------------------------

    @property
    def agents(self) -> list[str]:
        """The agents' adapters this trainer holds (not the shared one), sorted."""
        return sorted(a for a in self.slots if a != SHARED)

    def add_adapter(self, adapter: str) -> None:
        """A fresh adapter for `adapter` (the seeded initial weights, its own AdamW); a no-op if held."""
        if adapter in self.slots:
            return
        if self.max_adapters is not None and len(self.slots) + 1 > self.max_adapters:
            raise UnsupportedPerAgentSetting(
                f"agent {adapter!r} would be adapter {len(self.slots) + 1} (shared + {len(self.slots)} agents), "
                f"but the engine serves at most {self.max_adapters} at once (max_loras less one loading): raise "
                "InferenceConfig.max_loras, or list fewer agents in PerAgent(agents=...)"
            )
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
        self.use(self.active)

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

    # --- one step ----------------------------------------------------------------------------------------

    def split(self, groups: list[TrajectoryGroup]) -> dict[str, list[TrajectoryGroup]]:
        """Each adapter's view of the groups: per group, the trajectories with a call of its agent (a trajectory
        with no captured call belongs to the shared adapter). Adapters first seen here are added (logged)."""
        views: dict[str, list[TrajectoryGroup]] = {}
        for group in groups:
            members: dict[str, list[Any]] = {}
            for trajectory in group.trajectories:
                adapters = {self.per_agent.adapter_of(c.source) for c in trajectory.llm_calls} or {SHARED}
                for adapter in adapters:
                    members.setdefault(adapter, []).append(trajectory)
            for adapter, trajectories in members.items():
                view = copy.copy(group)  # its own list: the caller's group keeps every trajectory
                view.trajectories = trajectories
                views.setdefault(adapter, []).append(view)
        self._tell_unlisted(groups)
        for adapter in sorted(set(views) - set(self.slots)):
            self.add_adapter(adapter)
            log.info(
                "per-agent adapters: agent %r first seen at step %d; a fresh adapter", adapter, self.step + 1
            )
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
        return self._combined(results, groups, started)

    def prepare(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> tuple[list[TrainSequence], Metrics]:
        """The Trainer's, keeping only the selected adapter's calls trainable."""
        limit = self.seq_limit(config.max_seq_len)
        selected = self._selected
        select = None if selected is None else (lambda s: self.per_agent.adapter_of(s) == selected)
        sequences, metrics = prepare_groups(
            self.tokenizer, self.vocab_size, groups, config, max_seq_len=limit, select=select
        )
        check_not_future(groups, (v for s in sequences for v in s.versions), self.step)
        return sequences, metrics

    def _combined(
        self, results: dict[str, Metrics], groups: list[TrajectoryGroup], started: float
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
                "step": self.step,
            }
            if trained:
                norms = [m["grad_norm"] for m in trained.values()]
                metrics["grad_norm"] = math.sqrt(sum(n * n for n in norms))
                metrics["learning_rate"] = next(iter(trained.values()))["learning_rate"]
                fractions = [m["sampled_token_fraction"] for m in trained.values()]
                metrics["sampled_token_fraction"] = min(fractions)
                metrics.update(_staleness(list(trained.values())))
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

    def _tell_unlisted(self, groups: list[TrajectoryGroup]) -> None:
        """Once per key: an agent not in a fixed `agents` list trains the shared adapter."""
        if self.per_agent.agents is None:
            return
        for key in _keys(self.per_agent, groups) - set(self.per_agent.agents) - self._told:
            self._told.add(key)
            log.info(
                "per-agent adapters: %r is not in PerAgent(agents=...); its calls train the shared adapter",
                key,
            )

    def sft_step(self, trajectories: list[Any], config: Any) -> Metrics:
        """Refused: SFT would train the shared adapter only, and the agents' adapters start fresh, not from it."""
        raise UnsupportedPerAgentSetting(
            "train_sft with adapters=PerAgent(...) is not supported yet: it would train only the shared adapter "
            "(the agents' adapters start fresh); warm-start without PerAgent, or train with RL steps"
        )

    # --- state -------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """The shared adapter's files at `directory` (as a single-adapter trainer writes them), each agent's under
        `directory/agents/{adapter}/` (adapter, optimizer and trainer state)."""
        directory = Path(directory)
        try:
            for adapter in self.agents:
                self.use(adapter)
                adapter_io.save_trainer(
                    self, agent_checkpoint_dir(directory, adapter), self.slots[adapter].peft
                )
        finally:
            self.use(SHARED)
        return adapter_io.save_trainer(self, directory)

    def load(self, directory: str | Path) -> None:
        """Resume every adapter the checkpoint holds (a fixed `agents` list: only those; the others are named in
        a warning and not loaded), then the shared one (its step and rng win). Listed agents the checkpoint lacks
        start fresh; the warning says which changed."""
        directory = Path(directory)
        on_disk = set(checkpoint_agents(directory))
        listed = set(self.per_agent.listed()) if self.per_agent.agents is not None else None
        loading_ = on_disk if listed is None else on_disk & listed
        dropped, fresh = sorted(on_disk - loading_), sorted((listed or set()) - on_disk)
        # fresh with none on disk: a single-adapter run's checkpoint (its trained weights stay on the shared one)
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
        try:
            for adapter in sorted(loading_):
                self.add_adapter(adapter)
                self.use(adapter)
                adapter_io.load_trainer(self, agent_checkpoint_dir(directory, adapter))
        finally:
            self.use(SHARED)
        adapter_io.load_trainer(self, directory)

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


def _keys(per_agent: PerAgent, groups: Iterable[TrajectoryGroup]) -> set[str]:
    return {
        key
        for g in groups
        for t in g.trajectories
        for c in t.llm_calls
        if (key := per_agent.key_of(c.source)) is not None
    }
