"""LocalBackend's trainers: where they run (one process or sharded; which GPUs), loading one from the latest
checkpoint, running a step with the engine asleep when they share a GPU, saving and serving the new step, and
replacing a trainer that died (a failed rank, a lost process) from the last checkpoint on the next call."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model import Model, TrainableModel
from .serving import Registered, publish_step, served_prompt_logprobs

if TYPE_CHECKING:
    from ..config import ShardedTrainerOptions
    from ..training.sharded import ShardedTrainer
    from ..training.trainer import Trainer

log = logging.getLogger("art_adapters.backend.local")


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
            if state.trainer is not None:
                await asyncio.to_thread(state.trainer.close)
            state.trainer = await asyncio.to_thread(self._load_trainer, state.model, state.directory)
            state.step = state.trainer.step
            await publish_step(state, state.step)
            log.info("model %s resumed from checkpoint %04d", state.name, state.step)

    # ------------------------------------------------------------------ for tests and checks
    async def trainer(self, model: TrainableModel) -> Trainer | ShardedTrainer:
        """The model's trainer (loaded from its latest checkpoint when needed, or when the last one died)."""
        state = self._registered(model)
        return await self._live_trainer(state)

    async def served_logprob_diff(
        self, model: TrainableModel, token_ids: list[int], step: int | None = None
    ) -> float:
        """Max |vLLM logprob - trainer logprob| over `token_ids[1:]` for the adapter served as `name` (or
        `name@step`). Catches a hot-swap that silently left vLLM on another adapter (or the base model)."""
        state = self._registered(model)
        trainer = await self.trainer(model)
        served = await served_prompt_logprobs(
            state.server, state.gateway.adapter_name(state.name, step), token_ids
        )
        ours = await asyncio.to_thread(trainer.logprobs_of, token_ids)
        return max((abs(a - b) for a, b in zip(served, ours, strict=True)), default=0.0)

    def dedicated(self, state: Registered) -> bool:
        """Whether the model's trainer and its engine have GPUs of their own (then the engine never sleeps)."""
        trainer = set(self._trainer_gpus(state.model))
        engine = set(state.server.config.gpu_ids or [])
        return bool(trainer and engine and not trainer & engine)

    # ------------------------------------------------------------------ internals
    def _trainer_processes(self, model: TrainableModel) -> int:
        given = self.trainer_gpu_ids or model.trainer_gpu_ids()
        return self.trainer_processes or max(len(given), 1)

    def _trainer_gpus(self, model: TrainableModel) -> list[int]:
        given = self.trainer_gpu_ids or model.trainer_gpu_ids()
        return trainer_gpus(self._trainer_processes(model), given, cuda_devices())

    def _load_trainer(self, model: TrainableModel, directory: Path) -> Trainer | ShardedTrainer:
        """A trainer resumed from the latest checkpoint (optimizer included), or a fresh one saved as step 0.

        A fresh PEFT adapter has lora_B = 0 (and lm_head's delta is 0), so step 0 serves exactly the base policy.
        """
        from .. import checkpoints

        processes = self._trainer_processes(model)
        gpus = self._trainer_gpus(model)
        trainer: Trainer | ShardedTrainer
        if processes > 1 or self.trainer_nodes > 1:
            from ..training.sharded import ShardedTrainer

            trainer = ShardedTrainer(
                model.base_model,
                model.lora,
                processes=processes,
                gpu_ids=gpus or None,
                nodes=self.trainer_nodes,
                master=self.trainer_master,
                options=self.trainer_options,
            )
        else:
            from ..training.trainer import Trainer

            trainer = Trainer(model.base_model, model.lora, device=f"cuda:{gpus[0]}" if gpus else None)
        try:
            steps = checkpoints.list_steps(directory)
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

    async def _live_trainer(self, state: Registered) -> Trainer | ShardedTrainer:
        """The model's trainer; a dead one (a sharded trainer whose process failed) is replaced from the last
        checkpoint, which holds every step the backend has served."""
        trainer = state.trainer
        if trainer is not None and not getattr(trainer, "alive", True):
            log.warning(
                "model %s: the trainer died; replacing it from checkpoint %04d", state.name, state.step
            )
            await asyncio.to_thread(trainer.close)
            trainer = state.trainer = None
        if trainer is None:
            trainer = state.trainer = await asyncio.to_thread(
                self._load_trainer, state.model, state.directory
            )
            if trainer.step != state.step:  # a save abandoned mid-way that completed: the disk is the truth
                log.warning(
                    "model %s: the last checkpoint is %04d, not %04d", state.name, trainer.step, state.step
                )
                state.step = trainer.step
        return trainer

    async def _run_trainer(self, state: Registered, work: Any) -> dict[str, Any]:
        """Run `work(trainer)` in a thread with vLLM asleep (CUDA); a failure after the update, or one that killed
        the trainer, drops it (the next call loads the last checkpoint).

        A caller cancelled mid-step (an async run ending on another stage's error) returns at once; the thread
        finishes on its own, its update is dropped (no checkpoint holds it) and the next step reloads from disk."""
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
            trainer, state.trainer = state.trainer, None
            await asyncio.to_thread(trainer.close)
        trainer = await self._live_trainer(state)
        before = trainer.step
        dedicated = self.dedicated(state)
        if not dedicated:
            await state.server.sleep()
        running = asyncio.ensure_future(asyncio.to_thread(work, trainer))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            state.trainer, state.abandoned = None, asyncio.ensure_future(_drop(running, trainer))
            raise
        except BaseException:
            if trainer.step != before or not getattr(trainer, "alive", True):
                state.trainer = None  # the weights moved but no checkpoint holds them, or it died
                await asyncio.to_thread(trainer.close)
            raise
        finally:
            if not dedicated:
                await state.server.wake_up()

    def rollouts_pause_during_steps(self, model: TrainableModel) -> bool:
        """Whether the engine sleeps while this model's steps train (trainer and engine share a CUDA GPU)."""
        state = self._registered(model)
        server = state.server
        return server.on_cuda and server.config.sleep_mode_enabled(True) and not self.dedicated(state)

    async def _save_and_serve(self, state: Registered, *, unchanged: bool = False) -> None:
        """Save the trainer's new step (the last checkpoint's folder, renamed, when the weights are `unchanged`), serve
        it. A save that fails or whose caller is cancelled drops the trainer (its thread finishes on its own): the
        next call reloads from the last complete checkpoint, and `state.step` follows what is on disk."""
        from .. import checkpoints

        trainer = state.trainer
        assert trainer is not None
        if trainer.step != state.step + 1:
            state.trainer = None
            await asyncio.to_thread(trainer.close)
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
            state.trainer, state.abandoned = None, asyncio.ensure_future(_drop(running, trainer))
            raise
        except BaseException:
            state.trainer = None  # at a step no checkpoint may hold: the next call reloads from disk
            await asyncio.to_thread(trainer.close)
            raise
        state.step = new
        if move:
            await state.gateway.moved(state.name, old, moved)  # still served (same weights)
        await publish_step(state, state.step)


async def _drop(running: asyncio.Future[Any], trainer: Trainer | ShardedTrainer) -> None:
    """Let an abandoned step's thread finish, then release its trainer (its update is in no checkpoint)."""
    await asyncio.gather(running, return_exceptions=True)
    await asyncio.to_thread(trainer.close)
