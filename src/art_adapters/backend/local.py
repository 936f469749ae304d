"""LocalBackend: vLLM serves each model's latest LoRA adapter in a child process; the trainer steps in this one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import SFTConfig, TrainConfig
from ..model import Model, TrainableModel, check_model_name, check_name
from ..model_log import all_trajectories, best_step, record_log, rollout_metrics
from ..trajectories import Trajectory, TrajectoryGroup
from .base import ARTTraining, InferenceEndpoint
from .checkpoint_sync import CheckpointSync
from .serving import (
    Registered,
    engine_adapter_room,
    forget_all,
    publish_step,
    required_lora_rank,
    servable_steps,
    serve_checkpoint,
    sized_for_agents,
)
from .sft_run import Report, run_batches, streamed
from .trainers import TrainerHost, cuda_devices

if TYPE_CHECKING:
    from ..config import ShardedTrainerOptions
    from ..gpu_plan import Plan
    from ..inference import InferenceConfig, VLLMServer

log = logging.getLogger(__name__)


class LocalBackend(CheckpointSync, TrainerHost, ARTTraining):
    """Serves and trains models on this machine; files under `path` in ART's layout (`{project}/models/{name}`).

    Placement on CUDA: the memory plan (`gpu_plan.make_plan`) decides every setting left unset (GPUs, TP x
    replicas, vLLM's share, the sequence length, the trainer's dtype and checkpointing). `trainer_gpu_ids` and
    `InferenceConfig(gpu_ids=...)` (or ART's `_internal_config` `trainer_gpu_ids` / `inference_gpu_ids`) put the
    trainer and the engine on their own GPUs, so the engine never sleeps (the async pipeline's setting); sharing
    one GPU, ART's order: the engine sleeps while a step trains and the trainer waits on the CPU between steps.
    On the CPU both simply run.

    Past one GPU: `trainer_processes=N` trains each step data-parallel on N processes with FSDP2
    (`training/sharded.py`; on a CUDA host GPUs 0..N-1 unless `trainer_gpu_ids` says otherwise, gloo on the CPU);
    several `trainer_gpu_ids` imply it; `trainer_options` for activation checkpointing, HSDP and timeouts.
    Checkpoints are the same single adapter folder. Across hosts: `trainer_nodes=N, trainer_master="host:port"`
    makes this host node 0 (its rank 0 serves the rendezvous there); the others join with `art-adapters
    trainer-worker`, every host holding the same ART_ADAPTERS_TRAINER_TOKEN.

    Use it as is, or as a context manager (`with` / `async with`) that stops its servers on exit."""

    def __init__(
        self,
        path: str | Path | None = ".art",
        *,
        inference: InferenceConfig | None = None,
        trainer_gpu_ids: list[int] | None = None,
        trainer_processes: int | None = None,
        trainer_nodes: int = 1,
        trainer_master: str | None = None,
        trainer_options: ShardedTrainerOptions | None = None,
    ) -> None:
        self.path = Path(path if path is not None else ".art").resolve()  # None: ART's default folder
        self.inference = inference
        self.trainer_gpu_ids = list(trainer_gpu_ids or [])
        if trainer_processes is not None and trainer_processes < 1:
            raise ValueError(f"trainer_processes must be >= 1, not {trainer_processes}")
        self.trainer_processes = trainer_processes
        self.trainer_nodes = (
            trainer_nodes  # hosts in the sharded trainer; this one is node 0 at trainer_master
        )
        self.trainer_master = trainer_master
        self.trainer_options = trainer_options
        self._servers: dict[Path, VLLMServer] = {}  # by resolved base-model folder
        self._owned: list[VLLMServer] = []  # the servers this backend started (and stops on close)
        self._models: dict[Path, Registered] = {}  # by model folder
        self._base_plans: dict[
            Path, Plan | None
        ] = {}  # the memory plan each owned engine started from (CUDA)
        self._model_plans: dict[Path, Plan | None] = {}  # by model folder: its engine's plan
        self._model_max_len: dict[
            Path, int
        ] = {}  # by model folder: its engine's max_model_len (the trainer's too)
        self._model_max_loras: dict[
            Path, int
        ] = {}  # by model folder: its engine's max_loras (per-agent room)
        self._lock = asyncio.Lock()

    def use_server(self, server: VLLMServer) -> LocalBackend:
        """Serve models of `server.base_model` from this already-running server (close() leaves it running)."""
        self._servers[Path(server.base_model).resolve()] = server
        return self

    def model_dir(self, model: Model) -> Path:
        """`{path}/{project}/models/{name}` (names are checked, so it never lies outside `path`)."""
        name = check_model_name(model.name, model.trainable)
        return self.path / check_name("project", model.project) / "models" / name

    # ------------------------------------------------------------------ protocol
    async def register(self, model: Model) -> InferenceEndpoint:
        if not isinstance(model, TrainableModel):
            if not model.inference_base_url:
                raise ValueError(f"model {model.name!r} is not trainable and has no inference_base_url")
            return InferenceEndpoint(
                base_url=model.inference_base_url,
                api_key=model.inference_api_key or "none",
                model_name=model.inference_model_name or model.name,
                supports_token_ids=False,
            )
        from .. import checkpoints
        from ..inference import VLLMServer
        from ..inference.config import validate_model_dir
        from ..inference.gateway import gateway_of

        base = validate_model_dir(model.base_model)  # clear errors before any server starts
        rank = required_lora_rank(base, model)
        if model.lora.modules_to_save:
            from ..training.adapter_io import vllm_unservable_modules

            unservable = await asyncio.to_thread(vllm_unservable_modules, base, model.lora.modules_to_save)
            if unservable:
                raise ValueError(
                    f"model {model.name!r}: vLLM cannot serve LoRAConfig.modules_to_save={unservable} for "
                    f"{base.name}'s architecture; train without them"
                )
        directory = self.model_dir(model)
        model.base_path = str(
            self.path
        )  # as ART: the model's own files (state.json) live beside the backend's
        async with self._lock:
            server = self._servers.get(base)
            if server is None:
                config = self._engine_config(base, model, rank)  # the plan, GPU ids and placement checked
            if server is not None and server.config.max_lora_rank < rank:
                raise ValueError(
                    f"model {model.name!r} needs max_lora_rank >= {rank} (LoRA rank {model.lora.rank}"
                    f"{', lm_head as a full-rank delta' if model.lora.modules_to_save else ''}), but the server of "
                    f"{base.name} was started with max_lora_rank={server.config.max_lora_rank}"
                )
            self._model_plans[directory] = self._base_plans.get(base)
            engine = config if server is None else server.config
            self._model_max_len[directory] = engine.max_model_len
            engine_adapter_room(engine.max_loras, model)  # per-agent adapters: more than it holds, refused
            self._model_max_loras[directory] = engine.max_loras
            try:
                self.shares_cuda_gpu(model, config if server is None else server.config)  # placement checked
            except BaseException:
                self._model_plans.pop(directory, None)
                raise
            if server is None:
                server = VLLMServer(base, config, log_path=directory / "logs/vllm.log")
                self._servers[base] = server
                self._owned.append(server)
            gateway = gateway_of(server, server.config.limits)  # the one door to this server
            directory.mkdir(parents=True, exist_ok=True)
            checkpoints.clean_temp_dirs(directory)
            (directory / "model.json").write_text(
                model.model_dump_json(indent=2, exclude={"inference_api_key", "inference_base_url"}) + "\n"
            )
            state = self._models.get(directory)
            if state is not None and state.server is server:  # registered again: same step (and trainer)
                await self._registered_again(state, model)
            else:
                if (
                    state is not None and state.trainer is not None
                ):  # its old trainer goes before a new one loads
                    async with state.lock:
                        await self._drop_trainer(state)
                try:
                    trainer = await self._start(server, model, directory)
                except BaseException:
                    if server in self._owned and not server.running:
                        self._owned.remove(server)
                        self._servers.pop(base, None)
                    raise
                state = Registered(
                    model=model,
                    directory=directory,
                    server=server,
                    gateway=gateway,
                    trainer=trainer,
                    step=trainer.step,
                    lock=asyncio.Lock(),
                )
                try:
                    await publish_step(state, state.step)
                except BaseException:  # a failed registration leaves no name, and no trainer, behind
                    await forget_all(state)
                    await self._drop_trainer(state)
                    raise
                self._models[directory] = state
        return InferenceEndpoint(
            base_url=gateway.base_url,
            api_key=gateway.api_key,
            model_name=state.name,
            logprobs_mode=server.config.logprobs_mode,
        )

    async def get_step(self, model: TrainableModel) -> int:
        state = self._models.get(self.model_dir(model))
        if state is not None:
            return state.step
        from .. import checkpoints

        return checkpoints.latest_step(self.model_dir(model))

    async def train_events(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        """One GRPO step: train, save `checkpoints/{step+1:04d}` atomically, hot-load it, record metrics.

        A step that trains nothing (every group's rewards equal, say) still advances: the last checkpoint's
        folder is renamed to the new step, as in ART (the version it served keeps answering from memory)."""
        from .. import checkpoints

        state = self._registered(model)
        async with state.lock:
            step = state.step
            started = time.perf_counter()
            yield {"event": "started", "step": step, "groups": len(groups)}
            metrics = await self._run_trainer(
                state,
                lambda trainer: trainer.train_step(groups, config),
                save=lambda done: "skipped_reason" in done,  # nothing trained: the last folder, renamed
            )
            yield {"event": "trained", "step": step, "loss": metrics.get("loss")}
            metrics.update(rollout_metrics(groups))
            metrics["step_seconds"] = time.perf_counter() - started
            if record:
                checkpoints.write_trajectories(state.directory, "train", step, all_trajectories(groups))
                # ART's convention: rows and trajectory files carry the step the rollouts were sampled from.
                checkpoints.append_history(state.directory, {**metrics, "step": step, "split": "train"})
            if "skipped_reason" in metrics:
                log.warning(
                    "model %s step %d trained nothing: %s", model.name, step, metrics["skipped_reason"]
                )
            path = checkpoints.checkpoint_dir(state.directory, state.step)
            yield {"event": "done", "step": state.step, "metrics": metrics, "checkpoint_path": str(path)}

    async def train_sft_events(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[dict[str, Any]]:
        """Supervised steps on the trajectories' assistant turns, saved and served as one new step."""
        from .. import checkpoints

        state = self._registered(model)
        async with state.lock:
            step = state.step
            started = time.perf_counter()
            from ..training.prepare import sft_batches

            batches = list(sft_batches(list(trajectories), config))
            if batches:
                config.rate(0, len(batches))  # a list of rates of the wrong length: refused before any step
            yield {
                "event": "started",
                "step": step,
                "trajectories": len(trajectories),
                "batches": len(batches),
            }
            # one trainer job for the whole run: a shared GPU changes hands once, not once per batch
            metrics: dict[str, Any] = {}

            def start(report: Report, stop: threading.Event) -> Awaitable[dict[str, Any]]:
                return self._run_trainer(
                    state,
                    lambda trainer: run_batches(trainer, batches, config, report, stop),
                    save=lambda done: False,
                )

            # closed with this generator, so the run has stopped before the model's lock is released
            async with contextlib.aclosing(streamed(start)) as stream:
                async for event in stream:
                    if event["event"] == "result":
                        metrics = event["metrics"]
                    else:
                        yield {**event, "step": step}
            metrics.update(trajectories=len(trajectories), step_seconds=time.perf_counter() - started)
            checkpoints.append_history(state.directory, {"step": step, "split": "sft", **metrics})
            yield {"event": "done", "step": state.step, "metrics": metrics}

    async def log(
        self,
        model: Model,
        groups: list[TrajectoryGroup],
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record groups and metrics at `step` (default: the current one): trajectories/{split}/{step}.jsonl and a
        history row of `{split}/...` metrics (`{split}/reward` for `best_checkpoint_metric="val/reward"`)."""
        if step is None:
            step = await self.get_step(model) if isinstance(model, TrainableModel) else 0
        return await asyncio.to_thread(record_log, self.model_dir(model), groups, split, step, metrics)

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric` (default `val/reward`)."""
        from .. import checkpoints

        directory = self.model_dir(model)
        steps = checkpoints.list_steps(directory)
        if not steps:
            return []
        keep = {steps[-1]}
        best = best_step(
            checkpoints.read_history(directory), best_checkpoint_metric or "val/reward", set(steps)
        )
        if best is not None:
            keep.add(best)
        deleted = checkpoints.delete_checkpoints(directory, keep)
        state = self._models.get(directory)
        if state is not None and deleted:
            await forget_all(state, deleted)
        return deleted

    async def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps `serve_step` can serve: each checkpoint on disk, and step 0 (the base model) always."""
        return servable_steps(self.model_dir(model))

    async def serve_step(self, model: TrainableModel, step: int) -> str:
        """Serve checkpoint `step` as its own version beside the newest (which stays the model's name); returns
        the name that reaches it (`{project}/{name}@{step}`). An evaluation's way to any step."""
        return await serve_checkpoint(self._registered(model), step)

    async def close(self) -> None:
        """Stop the servers this backend started (not those given to `use_server`, whose gateways only stop
        serving this backend's models) and drop the trainers."""
        from ..inference.gateway import stop_gateway

        owned, self._owned = self._owned, []
        for state in self._models.values():
            if state.server not in owned:
                await forget_all(state)
            if state.trainer is not None:
                await asyncio.to_thread(state.trainer.close)
        for server in owned:
            stop_gateway(server)
            await server.stop()
        self._servers = {k: s for k, s in self._servers.items() if s not in owned}
        self._models.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the servers this backend started (synchronously; usable with no event loop running)."""
        from ..inference.gateway import stop_gateway

        owned, self._owned = self._owned, []
        for server in owned:
            stop_gateway(server)
            server.kill_now()
            server.process = None
        self._servers = {k: s for k, s in self._servers.items() if s not in owned}
        for state in self._models.values():
            if state.trainer is not None:
                state.trainer.close()
        self._models.clear()

    # ------------------------------------------------------------------ internals
    def _registered(self, model: TrainableModel) -> Registered:
        state = self._models.get(self.model_dir(model))
        if state is None:
            raise RuntimeError(
                f"model {model.name!r} (project {model.project!r}) is not registered with this LocalBackend: "
                "call `await model.register(backend)` first"
            )
        return state

    def _engine_config(self, base: Path, model: TrainableModel, rank: int) -> InferenceConfig:
        """The engine's settings: on CUDA, the installed versions checked, the GPU ids checked against the GPUs
        this process sees, and the memory plan's decision for each setting left unset (a plan that cannot fit
        raises PlanError here, before anything loads); on the CPU, the settings as given."""
        config = self._inference_config(model, rank)
        devices = cuda_devices()
        if devices == 0:
            self._base_plans[base] = None
            return config
        from .placement import cuda_engine_config

        given = self.trainer_gpu_ids or model.trainer_gpu_ids()
        config, plan = cuda_engine_config(
            config, base, model, given, self._trainer_processes(model), self._given_engine_fields(), devices
        )
        self._base_plans[base] = plan
        return config

    def _given_engine_fields(self) -> set[str]:
        return set(self.inference.model_fields_set) if self.inference is not None else set()

    def _inference_config(self, model: TrainableModel, rank: int) -> InferenceConfig:
        from ..inference import InferenceConfig

        config = self.inference or InferenceConfig()
        asked = model.inference_settings()  # only fields a model may choose (no engine flags, no environment)
        if asked:
            config = InferenceConfig.model_validate({**config.model_dump(exclude_unset=True), **asked})
        explicit = "max_lora_rank" in config.model_fields_set
        if config.max_lora_rank < rank:
            if explicit:
                raise ValueError(
                    f"model {model.name!r} needs max_lora_rank >= {rank} (LoRA rank {model.lora.rank}), "
                    f"but InferenceConfig.max_lora_rank={config.max_lora_rank}"
                )
            config = config.model_copy(update={"max_lora_rank": rank})
        return sized_for_agents(config, model)
