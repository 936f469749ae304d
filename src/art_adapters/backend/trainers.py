"""LocalBackend's trainers: where they run (one process or sharded; which GPUs), loading one from the latest
checkpoint, running a step with the engine asleep when they share a GPU, saving and serving the new step, and
replacing a trainer that died (a failed rank, a lost process) from the last checkpoint on the next call."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..agent_adapters import served_name
from ..checkpoints import agent_checkpoint_dir, checkpoint_agents
from ..model import Model, TrainableModel
from .engine_order import drop_abandoned, move_trainer, release_memory, sleep_engine, to_the_end
from .new_trainer import new_trainer
from .placement import placement_of
from .serving import (
    Registered,
    check_agent_room,
    engine_adapter_room,
    publish_step,
    served_prompt_logprobs,
)
from .sft_run import UnsavedWeights

if TYPE_CHECKING:
    from ..config import ShardedTrainerOptions
    from ..gpu_plan import Plan
    from ..inference import InferenceConfig, VLLMServer
    from ..training.sharded import ShardedTrainer
    from ..training.trainer import Trainer

log = logging.getLogger("art_adapters.backend.local")
T = TypeVar("T")


def trainer_gpus(processes: int, given: list[int], cuda_devices: int) -> list[int]:
    """The GPUs a trainer of `processes` processes uses: those `given`, else on a CUDA host GPUs 0..N-1 for a
    sharded trainer (a one-process trainer picks its device itself), else none (the CPU)."""
    if given:
        if processes > 1 and len(given) != processes:
            raise ValueError(f"trainer_processes={processes} needs as many trainer GPU ids, not {given}")
        return list(given)
    if processes <= 1 or cuda_devices == 0:
        return []
    if cuda_devices < processes:
        raise ValueError(
            f"trainer_processes={processes} needs {processes} GPUs and this host has {cuda_devices}: give "
            "trainer_gpu_ids, or fewer processes (CUDA_VISIBLE_DEVICES= trains on the CPU)"
        )
    return list(range(processes))


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class TrainerHost:
    """Mixed into LocalBackend, which provides the settings and `_models` / `_registered` / `model_dir`."""

    trainer_gpu_ids: list[int]
    trainer_processes: int | None
    trainer_nodes: int
    trainer_master: str | None
    trainer_options: ShardedTrainerOptions | None
    _models: dict[Path, Registered]

    if TYPE_CHECKING:  # LocalBackend's

        def _registered(self, model: TrainableModel) -> Registered: ...

        def model_dir(self, model: Model) -> Path: ...

    async def resume_from_disk(self, model: Model) -> None:
        """A registered model whose folder got a newer checkpoint (pulled, forked) resumes from it: its trainer
        loads it and it becomes the served version. Nothing to do for a model not registered here."""
        from .. import checkpoints

        state = self._models.get(self.model_dir(model))
        if state is None:
            return
        async with state.lock:
            steps = checkpoints.list_steps(state.directory)
            if not steps or steps[-1] == state.step:
                return
            await self._drop_trainer(state)  # closed (its memory freed) before the new one loads
            state.step = steps[-1]
            await self._run_trainer(state, lambda trainer: None)  # loads it, in the shared GPU's order
            await publish_step(state, state.step)
            log.info("model %s resumed from checkpoint %04d", state.name, state.step)

    async def _registered_again(self, state: Registered, model: TrainableModel) -> None:
        """`model` (a new instance, e.g. a restarted script's) registered again on the same engine: it takes over
        the model, and capture routes its agents' calls as the last publish did. Other per-agent settings reload the
        trainer from the last checkpoint with them (as a resume would, saying what changed): honoured, not ignored."""
        from .. import checkpoints
        from .serving import agent_keys

        if state.model.adapters != model.adapters:
            async with state.lock:
                log.warning(
                    "model %s registered again with adapters=%s (was %s): its trainer reloads checkpoint %04d",
                    state.name,
                    model.adapters,
                    state.model.adapters,
                    state.step,
                )
                dropped = agent_keys(state) if model.adapters is None else []
                await self._drop_trainer(state)
                state.model = model
                for key in dropped:  # no longer served: capture and the server's /v1 no longer reach them
                    await state.gateway.forget(key, None)
                await self._run_trainer(state, lambda trainer: None)  # loads it, in the shared GPU's order
        state.model = model
        model.route_agents(
            state.name, checkpoints.checkpoint_agents(checkpoints.checkpoint_dir(state.directory, state.step))
        )

    async def check_train(self, model: TrainableModel, groups: list[Any]) -> None:
        """What a step on `groups` would be refused for, raised before it starts (the server's 400): per-agent
        adapters beyond what the engine holds."""
        state = self._registered(model)
        check_agent_room(state, getattr(self, "_model_max_loras", {}).get(state.directory), groups)

    # ------------------------------------------------------------------ for tests and checks
    async def trainer(self, model: TrainableModel) -> Trainer | ShardedTrainer:
        """The model's trainer (loaded from its latest checkpoint when needed, or when the last one died). On a GPU
        it shares with the engine it is offloaded to CPU between steps: run work on it through `_run_trainer`."""
        state = self._registered(model)
        async with state.lock:
            if state.trainer is None or not getattr(state.trainer, "alive", True):
                await self._run_trainer(state, lambda trainer: None)
            assert state.trainer is not None
            return state.trainer

    async def served_logprob_diff(
        self,
        model: TrainableModel,
        token_ids: list[int],
        step: int | None = None,
        *,
        agent: str | None = None,
    ) -> float:
        """Max |vLLM logprob - trainer logprob| over `token_ids[1:]` for the adapter served as `name` (or
        `name@step`; with `agent`, that agent's adapter `name.{agent}`). Catches a hot-swap that silently left vLLM
        on another adapter (or the base model)."""
        state = self._registered(model)
        key = state.name if agent is None else served_name(state.name, agent)
        served = await served_prompt_logprobs(state.server, state.gateway.adapter_name(key, step), token_ids)

        def score(trainer: Any) -> list[float]:
            if agent is None:
                return trainer.logprobs_of(token_ids)
            return trainer.adapter_logprobs(agent, token_ids)

        async with state.lock:  # the engine sleeps while the trainer scores, on a shared GPU
            ours = await self._run_trainer(state, score)
        return max((abs(a - b) for a, b in zip(served, ours, strict=True)), default=0.0)

    def dedicated(self, state: Registered) -> bool:
        """Whether the model's trainer and its engine have GPUs of their own (then the engine never sleeps)."""
        plan = self._plan(state.model)
        trainer = self._trainer_gpus(state.model)
        return placement_of(trainer, state.server.config.gpu_ids, plan and plan.placement) == "dedicated"

    def shares_cuda_gpu(self, model: TrainableModel, config: InferenceConfig) -> bool:
        """Whether the model's trainer shares a CUDA GPU with the engine (then ART's order: the engine sleeps while
        a step trains, the trainer waits on the CPU between steps). A ValueError for GPUs that partly overlap
        (unless planned), and for a sharded trainer on the engine's GPUs (its processes cannot offload)."""
        if cuda_devices() == 0:
            return False
        plan = self._plan(model)
        trainer = self._trainer_gpus(model)
        if placement_of(trainer, config.gpu_ids, plan and plan.placement) == "dedicated":
            return False
        if self._trainer_processes(model) > 1 or self.trainer_nodes > 1:
            raise ValueError(
                f"a sharded trainer (GPUs {trainer}) cannot share the inference GPUs {config.gpu_ids or 'default'}: "
                "its processes cannot offload between steps; give the engine GPUs of its own (inference gpu_ids)"
            )
        return True

    async def _start(
        self, server: VLLMServer, model: TrainableModel, directory: Path
    ) -> Trainer | ShardedTrainer:
        """Start the engine (unless running) and load the model's trainer. On a CUDA GPU they share, ART's order:
        the trainer loads first and is offloaded to CPU, then vLLM starts (its start-up measures free memory, so
        the two never load at once); on a running engine the load happens while it sleeps. Elsewhere (CPU, or
        GPUs of their own) the two overlap. A failure leaves no trainer loaded."""
        loaded: list[Trainer | ShardedTrainer] = []

        def load() -> Trainer | ShardedTrainer:
            loaded.append(self._load_trainer(model, directory))
            return loaded[0]

        running = server.running
        try:
            if not self.shares_cuda_gpu(model, server.config):
                loading = asyncio.ensure_future(asyncio.to_thread(load))
                try:
                    await server.start()
                finally:  # the load is waited out either way (a trainer no one holds is never left loaded)
                    await asyncio.gather(loading, return_exceptions=True)
                return loading.result()
            if running:
                await sleep_engine(server)
                await asyncio.to_thread(release_memory)
            try:
                trainer = await to_the_end(load)
                await to_the_end(functools.partial(move_trainer, trainer, "offload"))
            except BaseException:  # closed (its memory freed) before the engine wakes into that memory
                while loaded:
                    await asyncio.to_thread(loaded.pop().close)
                raise
            finally:
                await asyncio.to_thread(release_memory)
                if running:
                    await server.wake_up()
            if not running:
                await server.start()
            return trainer
        except BaseException:
            for trainer in loaded:
                await asyncio.to_thread(trainer.close)
            raise

    # ------------------------------------------------------------------ internals
    def _plan(self, model: TrainableModel) -> Plan | None:
        """The memory plan the model registered with (None on CPU, or with an engine given to `use_server`)."""
        plans: dict[Path, Plan | None] = getattr(self, "_model_plans", {})
        return plans.get(self.model_dir(model)) if plans else None

    def _trainer_processes(self, model: TrainableModel) -> int:
        given = self.trainer_gpu_ids or model.trainer_gpu_ids()
        return self.trainer_processes or max(len(given), 1)

    def _trainer_gpus(self, model: TrainableModel) -> list[int]:
        given = self.trainer_gpu_ids or model.trainer_gpu_ids()
        if not given and self._trainer_processes(model) <= 1:
            plan = self._plan(model)
            given = list(plan.trainer_gpu_ids) if plan is not None else []
        return trainer_gpus(self._trainer_processes(model), given, cuda_devices())

    def _load_trainer(self, model: TrainableModel, directory: Path) -> Trainer | ShardedTrainer:
        """A trainer resumed from the latest checkpoint (optimizer included), or a fresh one saved as step 0.

        A fresh PEFT adapter has lora_B = 0 (and lm_head's delta is 0), so step 0 serves exactly the base policy.
        """
        from .. import checkpoints

        steps = checkpoints.list_steps(directory)
        latest = checkpoints.checkpoint_dir(directory, steps[-1]) if steps else None
        trainer = new_trainer(
            model,
            processes=self._trainer_processes(model),
            gpus=self._trainer_gpus(model),
            plan=self._plan(model),
            max_seq_len=getattr(self, "_model_max_len", {}).get(directory),
            adapter_room=self._adapter_room(model, directory),
            latest_agents=checkpoint_agents(latest) if latest is not None else [],
            nodes=self.trainer_nodes,
            master=self.trainer_master,
            options=self.trainer_options,
        )
        try:
            if steps:
                trainer.load(checkpoints.checkpoint_dir(directory, steps[-1]))
                if trainer.step != steps[-1]:
                    log.warning(
                        "checkpoint %04d holds trainer step %d; using %d", steps[-1], trainer.step, steps[-1]
                    )
                    trainer.step = steps[-1]
            else:
                checkpoints.save_checkpoint(directory, 0, trainer.save)
        except BaseException:
            trainer.close()
            raise
        return trainer

    def _adapter_room(self, model: TrainableModel, directory: Path) -> int | None:
        """How many of the model's adapters its engine holds (None: no engine known, or no PerAgent)."""
        max_loras = getattr(self, "_model_max_loras", {}).get(directory)
        return engine_adapter_room(max_loras, model) if max_loras is not None else None

    async def _live_trainer(self, state: Registered) -> Trainer | ShardedTrainer:
        """The model's trainer; a dead one (a sharded trainer whose process failed) is closed first (its memory
        freed), then replaced from the last checkpoint, which holds every step the backend has served. A load the
        caller is cancelled during still lands in `state.trainer` (so it is offloaded or closed, never leaked)."""
        if state.trainer is not None and not getattr(state.trainer, "alive", True):
            log.warning(
                "model %s: the trainer died; replacing it from checkpoint %04d", state.name, state.step
            )
            await self._drop_trainer(state)
        if state.trainer is None:

            def load() -> Trainer | ShardedTrainer:
                state.trainer = self._load_trainer(state.model, state.directory)
                return state.trainer

            trainer = await to_the_end(load)
            if trainer.step != state.step:  # a save abandoned mid-way that completed: the disk is the truth
                log.warning(
                    "model %s: the last checkpoint is %04d, not %04d", state.name, trainer.step, state.step
                )
                state.step = trainer.step
        assert state.trainer is not None
        return state.trainer

    async def _drop_trainer(self, state: Registered) -> None:
        """Close the model's trainer (its memory freed) and forget it: the next call loads the last checkpoint."""
        trainer, state.trainer = state.trainer, None
        if trainer is not None:
            await asyncio.to_thread(trainer.close)

    async def _run_trainer(
        self, state: Registered, work: Callable[[Any], T], *, save: Callable[[T], bool] | None = None
    ) -> T:
        """Run `work(trainer)` in a thread; with `save`, then save the new step (`save(result)`: whether the
        weights are unchanged, so the last checkpoint's folder is renamed) and serve it.

        On a GPU shared with the engine, in ART's order: sleep the engine (level 1), free the allocator's cache,
        reload the trainer onto the GPU (or load it, the old one closed first), work, save; then, whatever
        happened, offload the trainer to CPU, free the cache, wake the engine, and only then load the adapter.
        A failure after the update, or one that killed the trainer, drops it (the next call loads the last
        checkpoint). A caller cancelled mid-step returns at once; the thread finishes on its own, its update is
        dropped (no checkpoint holds it), its trainer closed, and then the engine wakes; the next step reloads
        from disk."""
        if state.abandoned is not None:  # wait out an abandoned step: it still uses the trainer's weights
            await asyncio.gather(state.abandoned, return_exceptions=True)
            state.abandoned = None
        if state.trainer is not None and state.trainer.step != state.step:  # a step left unsaved (its caller
            # went away between the update and the save): no checkpoint holds its weights
            log.warning(
                "model %s: the trainer is at step %d, not %d; reloading",
                state.name,
                state.trainer.step,
                state.step,
            )
            await self._drop_trainer(state)
        shared = not self.dedicated(state)
        saved: tuple[int, Path | None] | None = None
        if shared:
            await sleep_engine(state.server)
            await asyncio.to_thread(release_memory)
        try:
            trainer = await self._live_trainer(state)
            if shared:
                await to_the_end(functools.partial(move_trainer, trainer, "reload"))
            before = trainer.step
            running = asyncio.ensure_future(asyncio.to_thread(work, trainer))
            try:
                result = await asyncio.shield(running)
            except asyncio.CancelledError:
                state.trainer = None
                state.abandoned = asyncio.ensure_future(
                    drop_abandoned(running, trainer, state.server if shared else None)
                )
                raise
            except BaseException as error:
                moved = trainer.step != before or isinstance(error, UnsavedWeights)
                if moved or not getattr(trainer, "alive", True):
                    # the weights moved but no checkpoint holds them, or it died
                    await self._drop_trainer(state)
                raise
            if save is not None:
                saved = await self._save(state, trainer, unchanged=save(result))
        finally:
            # (an abandoned step wakes the engine itself, once its thread has ended)
            if shared and state.abandoned is None:
                await self._release_and_wake(state)
        if saved is not None:
            await self._serve(state, *saved)
        return result

    async def _release_and_wake(self, state: Registered) -> None:
        """After a step on a shared GPU: the trainer to CPU, the allocator's cache emptied, the engine woken (it
        wakes even when the offload failed; that trainer is then closed)."""
        try:
            if state.trainer is not None:
                await to_the_end(functools.partial(move_trainer, state.trainer, "offload"))
        except Exception:
            log.exception("model %s: offloading the trainer failed; closing it", state.name)
            await self._drop_trainer(state)
        finally:
            await asyncio.to_thread(release_memory)
            await state.server.wake_up()

    def rollouts_pause_during_steps(self, model: TrainableModel) -> bool:
        """Whether the engine sleeps while this model's steps train (trainer and engine share a CUDA GPU)."""
        state = self._registered(model)
        server = state.server
        return server.on_cuda and server.config.sleep_mode_enabled(True) and not self.dedicated(state)

    async def _save(
        self, state: Registered, trainer: Trainer | ShardedTrainer, *, unchanged: bool
    ) -> tuple[int, Path | None]:
        """Save the trainer's new step (the last checkpoint's folder, renamed, when the weights are `unchanged`);
        returns the old step and the renamed folder (None: saved anew), for `_serve`. A save that fails or whose
        caller is cancelled drops the trainer (its thread finishes on its own): the next call reloads from the
        last complete checkpoint, and `state.step` follows what is on disk."""
        from .. import checkpoints

        if trainer.step != state.step + 1:
            await self._drop_trainer(state)
            raise RuntimeError(
                f"trainer is at step {trainer.step}, expected {state.step + 1}; reload from disk"
            )
        old, new = state.step, trainer.step
        move = unchanged and old in checkpoints.list_steps(state.directory)
        if move:
            work = functools.partial(checkpoints.move_checkpoint, state.directory, old, new)
        else:
            work = functools.partial(checkpoints.save_checkpoint, state.directory, new, trainer.save)
        running = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            moved = await asyncio.shield(running)
        except asyncio.CancelledError:
            shared = not self.dedicated(state)
            state.trainer = None
            state.abandoned = asyncio.ensure_future(
                drop_abandoned(running, trainer, state.server if shared else None)
            )
            raise
        except BaseException:  # at a step no checkpoint may hold: the next call reloads from disk
            await self._drop_trainer(state)
            raise
        state.step = new
        return old, moved if move else None

    async def _serve(self, state: Registered, old: int, moved: Path | None) -> None:
        """Serve the step just saved (the engine awake): a renamed folder keeps answering as the same weights."""
        if moved is not None:
            await state.gateway.moved(state.name, old, moved)  # still served (same weights)
            for adapter in checkpoint_agents(moved):  # per-agent adapters moved with it
                await state.gateway.moved(
                    served_name(state.name, adapter), old, agent_checkpoint_dir(moved, adapter)
                )
        await publish_step(state, state.step)
