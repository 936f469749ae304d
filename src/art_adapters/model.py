"""Model (any OpenAI-compatible endpoint) and TrainableModel (served and trained by a Backend), ART's names."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from .agent_adapters import AgentRouting, PerAgent, UnsupportedPerAgentSetting
from .config import LoRAConfig, SFTConfig, TrainConfig
from .costs import CostCalculator, no_cost
from .trajectories import Trajectory, TrajectoryGroup
from .untrusted import check_name

if TYPE_CHECKING:
    import openai

# What a model may ask of its inference server (engine flags and environment are the server operator's).
MODEL_INFERENCE_FIELDS = frozenset(
    {
        "max_model_len",
        "max_num_seqs",
        "gpu_memory_utilization",
        "enforce_eager",
        "enable_sleep_mode",
        "max_lora_rank",
        "max_loras",
        "gpu_ids",
    }
)


PROMPTED_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}(/[A-Za-z0-9._-]{1,64}){0,3}")


def check_model_name(value: str, trainable: bool) -> str:
    """A model's name: a trainable model's is one path-safe segment; a prompted (not trained) model's may hold
    "/" as ART allows (a provider's `org/model`), each segment path-safe, so its log folder stays inside."""
    if trainable:
        return check_name("model", value)
    if (
        not isinstance(value, str)
        or not PROMPTED_NAME_PATTERN.fullmatch(value)
        or any(part in {".", ".."} for part in value.split("/"))
    ):
        raise ValueError(
            f"model name {value!r} must be up to four '/'-separated segments of [A-Za-z0-9._-] (none '.' or '..')"
        )
    return value


def issubclass_trainable(cls: type) -> bool:
    return any(base.__name__ == "TrainableModel" for base in cls.__mro__)


class InferenceEndpoint(BaseModel):
    """Where a registered model is served: an OpenAI-compatible base URL, its key and the served name."""

    base_url: str
    api_key: str
    model_name: str
    supports_token_ids: bool = True
    logprobs_mode: str | None = (
        None  # what the engine's logprobs are (None: unknown, e.g. someone else's API)
    )


@runtime_checkable
class Backend(Protocol):
    async def register(self, model: Model) -> InferenceEndpoint:
        """Make the model servable (start or reuse the engine, load its latest checkpoint)."""
        ...

    async def get_step(self, model: TrainableModel) -> int: ...

    def train_events(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        """Take one GRPO step. Yields progress events; the last has `"event": "done"`, the new step and its
        metrics. `record`: also write the step's trajectories and history row (`model.train`; ART's
        `backend.train` leaves that to `model.log`)."""
        ...

    def train_sft_events(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[dict[str, Any]]: ...

    async def log(
        self,
        model: Model,
        groups: list[TrajectoryGroup],
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record groups (trajectories and `{split}/...` metrics) and extra metrics at `step` (default: current)."""
        ...

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        """Delete all checkpoints but the latest and the best by the metric; returns the deleted steps."""
        ...

    async def close(self) -> None: ...


class Model(BaseModel):
    """A model behind any OpenAI-compatible endpoint. Rollouts can use it and `log` records them; not trained."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    project: str = "default"
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    config: Any = None
    inference_base_url: str | None = None
    inference_api_key: str | None = None
    inference_model_name: str | None = None
    base_path: str = ".art"
    report_metrics: list[str] | None = None
    trainable: bool = False

    _backend: Backend | None = PrivateAttr(default=None)
    _endpoint: InferenceEndpoint | None = PrivateAttr(default=None)
    _client: openai.AsyncOpenAI | None = PrivateAttr(default=None)

    @field_validator("project")
    @classmethod
    def _safe_project(cls, value: str) -> str:
        return check_name("project", value)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        """Checked as a field (errors name it); a TrainableModel's name is one folder."""
        return check_model_name(value, trainable=issubclass_trainable(cls))

    @model_validator(mode="after")
    def _trainable_name(self) -> Model:
        if self.trainable:  # a plain Model constructed with trainable=True trains too
            check_model_name(self.name, True)
        return self

    async def register(self, backend: Backend) -> None:
        """Attach the model to a backend, which starts (or reuses) its inference server."""
        self._backend = backend
        self._endpoint = await backend.register(self)
        self.inference_base_url = self._endpoint.base_url
        self.inference_api_key = self._endpoint.api_key
        if self.trainable:
            self.inference_model_name = self._endpoint.model_name
        self._client = None

    def backend(self) -> Backend:
        """The backend this model is registered with (ART's method)."""
        if self._backend is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_model_name or self.name

    def openai_client(self) -> openai.AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint, recording every call into the current capture."""
        if self.inference_base_url is None:
            raise RuntimeError(
                f"model {self.name!r} has no inference endpoint: register it or set inference_base_url"
            )
        if self._client is None:
            from .recording import async_openai_client

            token_ids = self._endpoint.supports_token_ids if self._endpoint else False
            self._client = async_openai_client(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                request_token_ids=token_ids,
                annotate_choices=token_ids,
                logprobs_mode=self._endpoint.logprobs_mode if self._endpoint else None,
                routing=self.agent_routing(),
            )
        return self._client

    def agent_routing(self) -> AgentRouting | None:
        """Per-agent adapters' routing for capture (a TrainableModel with `adapters=art.PerAgent(...)`, once
        registered); None otherwise."""
        return None

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.acompletion(...)` that reach this model (ART's helper)."""
        name = self.get_inference_name(step)
        return {
            "model": f"hosted_vllm/{name}" if self.trainable else name,
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key,
            "temperature": 1,
        }

    async def get_step(self) -> int:
        """The model's training step (0 for a model that is not trained)."""
        return 0

    # ---- persistent state (ART's): `{base_path}/{project}/models/{name}/state.json` -----------------------------

    def state_path(self) -> Path:
        return (
            Path(self.base_path)
            / check_name("project", self.project)
            / "models"
            / check_model_name(self.name, self.trainable)
            / "state.json"
        )

    def read_state(self) -> dict[str, Any] | None:
        """The state a run persisted (dataset position, pipeline progress), or None."""
        path = self.state_path()
        return json.loads(path.read_text()) if path.is_file() else None

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace the persisted state (JSON, written atomically: a crash leaves the old or the new, whole)."""
        path = self.state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, path)

    def write_state(self, state: dict[str, Any]) -> None:
        """ART's older name of `overwrite_state`."""
        self.overwrite_state(state)

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep-merge `state` into the persisted state; returns what was written."""
        merged = _deep_merge(self.read_state() or {}, state)
        self.overwrite_state(merged)
        return merged

    async def log(
        self,
        trajectories: Iterable[Trajectory | BaseException] | Iterable[TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record trajectories (written to `trajectories/{split}/{step:04d}.jsonl`) and/or metrics (a row of
        `history.jsonl`, keys prefixed `{split}/`) at `step` (default: the current step). Returns the row's metrics."""
        groups = as_groups(trajectories)
        if self._backend is not None:
            return await self._backend.log(self, groups, split, metrics=metrics, step=step)  # type: ignore[arg-type]
        from .checkpoints import model_dir
        from .model_log import record_log

        at = step if step is not None else await self.get_step()
        directory = model_dir(self.project, self.name, self.base_path)
        return await asyncio.to_thread(record_log, directory, groups, split, at, metrics)


def _deep_merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def as_groups(items: Iterable[Any] | None) -> list[TrajectoryGroup]:
    """ART's `log` input (groups, or trajectories and exceptions) as a list of groups."""
    items = list(items or [])
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    if any(isinstance(i, TrajectoryGroup) for i in items):
        raise TypeError("log() takes trajectory groups or trajectories, not a mix of both")
    return [TrajectoryGroup(items)] if items else []


class TrainableModel(Model):
    """A model whose LoRA adapter a Backend trains; `name` always serves its latest step."""

    base_model: str
    trainable: bool = True
    lora: LoRAConfig = Field(default_factory=LoRAConfig, validation_alias=AliasChoices("lora", "lora_config"))
    inference: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Inference-server settings this model asks for: {sorted(MODEL_INFERENCE_FIELDS)}.",
    )
    adapters: PerAgent | None = Field(
        None,
        description="`art.PerAgent(...)`: one LoRA adapter per agent on the shared base (docs/multi-agent.md).",
    )
    _agent_routing: AgentRouting | None = PrivateAttr(default=None)
    _internal_config: dict[str, Any] | None = PrivateAttr(default=None)
    _client_engine_args: dict[str, Any] = PrivateAttr(default_factory=dict)
    _cost_calculator: CostCalculator = PrivateAttr(default_factory=lambda: no_cost)

    @property
    def cost_calculator(self) -> CostCalculator:
        """ART's per-call cost function (`prompt_tokens, completion_tokens, cost_context -> {"costs/...": $}`);
        none by default (`art_adapters.costs.build_cost_calculator(ModelPricing(...))` makes one)."""
        return self._cost_calculator

    def set_cost_calculator(self, calculator: CostCalculator | None) -> None:
        self._cost_calculator = calculator if calculator is not None else no_cost

    def __init__(self, **data: Any) -> None:
        internal = data.pop("_internal_config", None)
        super().__init__(**data)
        if internal is not None:
            self._internal_config = dict(internal)

    @model_validator(mode="after")
    def _per_agent_settings(self) -> TrainableModel:
        if self.adapters is not None and self.lora.modules_to_save:
            raise UnsupportedPerAgentSetting(
                f"adapters=PerAgent(...) with LoRAConfig.modules_to_save={self.lora.modules_to_save}: each agent "
                "would need its own full module copy, and vLLM serves none for several adapters; train without it"
            )
        return self

    def agent_routing(self) -> AgentRouting | None:
        return self._agent_routing

    def route_agents(self, model_key: str, served: list[str]) -> None:
        """Called by the backend whenever it publishes: capture routes each agent among `served` (adapter names) to
        `{model_key}.{adapter}`; the others stay on the shared adapter. A no-op without `adapters`."""
        if self.adapters is None:
            return
        routing = self._agent_routing
        if routing is None or routing.model_key != model_key or routing.per_agent is not self.adapters:
            routing = self._agent_routing = AgentRouting(self.adapters, model_key, self.name)
            self._client = None  # built again with the routing
        routing.set_served(served)

    @field_validator("inference")
    @classmethod
    def _inference_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - MODEL_INFERENCE_FIELDS)
        if unknown:
            raise ValueError(
                f"inference settings {unknown} cannot be chosen by a model (allowed: {sorted(MODEL_INFERENCE_FIELDS)}); "
                "engine arguments and environment are the backend's: LocalBackend(inference=InferenceConfig(...))"
            )
        return value

    def inference_settings(self) -> dict[str, Any]:
        """The inference settings asked for: `_internal_config` (ART's engine_args, inference_gpu_ids), then
        `register(_openai_client_config=...)`'s engine_args, then `inference`."""
        from .compat import internal_settings

        engine, _ = internal_settings(self._internal_config)
        return self._inference_fields({**engine, **self._client_engine_args, **self.inference})

    def trainer_gpu_ids(self) -> list[int]:
        """ART's `_internal_config.trainer_gpu_ids`: the GPUs the trainer runs on (empty: the default device)."""
        from .compat import gpu_ids

        return gpu_ids(
            (self._internal_config or {}).get("trainer_gpu_ids"), "_internal_config.trainer_gpu_ids"
        )

    def trainer_max_seq_len(self) -> int | None:
        """ART's `_internal_config.init_args.max_seq_length`: the longest sequence the trainer is loaded for
        (Unsloth's `max_seq_length`, `Trainer(max_seq_len=...)`) and every step's limit; None: the backend's."""
        from .compat import internal_settings

        return internal_settings(self._internal_config)[1].get("max_seq_len")

    def train_defaults(self, config: TrainConfig | None) -> TrainConfig:
        """`config` with the fields it leaves unset taken from `_internal_config` (init_args, trainer_args)."""
        from .compat import internal_settings

        config = config or TrainConfig()
        _, defaults = internal_settings(self._internal_config)
        unset = {k: v for k, v in defaults.items() if k not in config.model_fields_set}
        return config.model_copy(update=unset) if unset else config

    def get_inference_name(self, step: int | None = None) -> str:
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def register(self, backend: Backend, _openai_client_config: dict[str, Any] | None = None) -> None:
        from .compat import openai_client_engine_args

        self._client_engine_args = openai_client_engine_args(_openai_client_config)
        self.inference_settings()  # an unsupported _internal_config fails here, before any server starts
        self.trainer_gpu_ids()
        await super().register(backend)

    async def get_step(self) -> int:
        return await self.backend().get_step(self)

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> dict[str, Any]:
        """One GRPO step on the groups; the new adapter is served when this returns. Returns the step's metrics.

        `_config`: ART's `art.dev.TrainConfig` knobs, mapped onto `config` (see `art_adapters.compat`)."""
        from .compat import train_config

        settings = train_config(self.train_defaults(config), _config, where="model.train(_config=...)")
        result: dict[str, Any] = {}
        async for event in self.backend().train_events(self, list(trajectory_groups), settings):
            if verbose and event.get("event") != "done":
                print(event)
            if event.get("event") == "done":
                result = event.get("metrics", {})
        return result

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: SFTConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> dict[str, Any]:
        """Supervised steps on the assistant turns of the trajectories (a warm start)."""
        from .compat import sft_config

        settings = sft_config(config, _config)
        result: dict[str, Any] = {}
        async for event in self.backend().train_sft_events(self, list(trajectories), settings):
            if verbose and event.get("event") != "done":
                print(event)
            if event.get("event") == "done":
                result = event.get("metrics", {})
        return result

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every checkpoint but the latest and the best by the metric; returns the deleted steps."""
        return await self.backend().delete_checkpoints(self, best_checkpoint_metric)
