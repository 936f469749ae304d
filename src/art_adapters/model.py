"""Model (any OpenAI-compatible endpoint) and TrainableModel (served and trained by a Backend), ART's names."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from .config import LoRAConfig, SFTConfig, TrainConfig
from .trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import openai

    from .backend.base import Backend, InferenceEndpoint

NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    if not NAME_PATTERN.match(value) or value in {".", ".."}:
        raise ValueError(f"{kind} name {value!r} must match {NAME_PATTERN.pattern} (and not be '.' or '..')")
    return value


class Model(BaseModel):
    """A model behind any OpenAI-compatible endpoint. Rollouts can use it; it is not trained."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    project: str = "default"
    inference_base_url: str | None = None
    inference_api_key: str | None = None
    inference_model_name: str | None = None
    trainable: bool = False
    config: dict[str, Any] = Field(default_factory=dict)

    _backend: Backend | None = PrivateAttr(default=None)
    _endpoint: InferenceEndpoint | None = PrivateAttr(default=None)
    _client: openai.AsyncOpenAI | None = PrivateAttr(default=None)

    @field_validator("name", "project")
    @classmethod
    def _safe_name(cls, value: str, info: Any) -> str:
        return check_name(info.field_name, value)

    async def register(self, backend: Backend) -> None:
        """Attach the model to a backend, which starts (or reuses) its inference server."""
        self._backend = backend
        self._endpoint = await backend.register(self)
        self.inference_base_url = self._endpoint.base_url
        self.inference_api_key = self._endpoint.api_key
        self._client = None

    @property
    def backend(self) -> Backend:
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
            )
        return self._client


class TrainableModel(Model):
    """A model whose LoRA adapter a Backend trains; `name` always serves its latest step."""

    base_model: str
    trainable: bool = True
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    inference: dict[str, Any] = Field(
        default_factory=dict, description="InferenceConfig fields for the server."
    )

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    async def get_step(self) -> int:
        return await self.backend.get_step(self)

    async def train(
        self,
        trajectory_groups: list[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        verbose: bool = False,
    ) -> dict[str, Any]:
        """One GRPO step on the groups; the new adapter is served when this returns. Returns the step's metrics."""
        result: dict[str, Any] = {}
        async for event in self.backend.train(self, list(trajectory_groups), config or TrainConfig()):
            if verbose and event.get("event") != "done":
                print(event)
            if event.get("event") == "done":
                result = event.get("metrics", {})
        return result

    async def train_sft(
        self, trajectories: list[Trajectory], config: SFTConfig | None = None
    ) -> dict[str, Any]:
        """Supervised steps on the assistant turns of the trajectories (a warm start)."""
        result: dict[str, Any] = {}
        async for event in self.backend.train_sft(self, list(trajectories), config or SFTConfig()):
            if event.get("event") == "done":
                result = event.get("metrics", {})
        return result

    async def log(
        self, trajectories: list[TrajectoryGroup] | list[Trajectory], split: str = "val"
    ) -> dict[str, float]:
        """Record evaluation rollouts at the current step (e.g. `val/reward_mean` for `delete_checkpoints`)."""
        groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup([g]) for g in trajectories]
        return await self.backend.log(self, groups, split)

    async def delete_checkpoints(self, best_checkpoint_metric: str | None = None) -> list[int]:
        return await self.backend.delete_checkpoints(self, best_checkpoint_metric)
