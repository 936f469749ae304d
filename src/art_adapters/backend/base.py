"""The Backend protocol: what LocalBackend and RemoteBackend both do for a model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

if TYPE_CHECKING:
    from ..config import SFTConfig, TrainConfig
    from ..model import Model, TrainableModel
    from ..trajectory import Trajectory, TrajectoryGroup


class InferenceEndpoint(BaseModel):
    """Where a registered model is served: an OpenAI-compatible base URL, its key and the served name."""

    base_url: str
    api_key: str
    model_name: str
    supports_token_ids: bool = True


@runtime_checkable
class Backend(Protocol):
    async def register(self, model: Model) -> InferenceEndpoint:
        """Make the model servable (start or reuse the engine, load its latest checkpoint)."""
        ...

    async def get_step(self, model: TrainableModel) -> int: ...

    def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> AsyncIterator[dict[str, Any]]:
        """Take one GRPO step. Yields progress events; the last has `"event": "done"` and the step's metrics."""
        ...

    def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[dict[str, Any]]: ...

    async def log(
        self, model: TrainableModel, groups: list[TrajectoryGroup], split: str = "val"
    ) -> dict[str, float]:
        """Record evaluation groups (trajectories and `{split}/...` metrics) at the model's current step."""
        ...

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        """Delete all checkpoints but the latest and the best by the metric; returns the deleted steps."""
        ...

    async def close(self) -> None: ...
