"""The Backend protocol (what LocalBackend and RemoteBackend both do for a model) and ART's calls on top of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from ..compat import LocalTrainResult, TrainResult, UnsupportedARTSetting, art_backend_train_config

if TYPE_CHECKING:
    from ..config import SFTConfig, TrainConfig
    from ..model import Model, TrainableModel
    from ..trajectories import Trajectory, TrajectoryGroup


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


class ARTTraining:
    """ART's backend-first calls (`backend.train(model, groups, **settings)`, the S3 names), shared by
    LocalBackend and RemoteBackend and built on the protocol's `train_events`: a backend that inherits it gets
    them for free."""

    def train_events(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError  # each backend defines it

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        *,
        config: TrainConfig | None = None,
        verbose: bool = False,
        **art_settings: Any,
    ) -> TrainResult:
        """One step (ART >= 0.5.18): `learning_rate=`, `loss_fn="cispo"|"ppo"`, `epsilon=`, `epsilon_high=`,
        `scale_rewards=`, `importance_sampling_level=`, `kl_penalty_coef=` ... (ART's defaults: CISPO, lr 5e-6).
        Trajectories and metrics are not logged: call `model.log(groups, metrics=result.metrics,
        step=result.step, split="train")` as in ART."""
        settings = art_backend_train_config(art_settings, model.train_defaults(config))
        done: dict[str, Any] = {}
        async for event in self.train_events(model, list(trajectory_groups), settings, record=False):
            if verbose and event.get("event") != "done":
                print(event)
            if event.get("event") == "done":
                done = event
        metrics = {k: float(v) for k, v in done.get("metrics", {}).items() if isinstance(v, int | float)}
        if "checkpoint_path" in done:
            return LocalTrainResult(
                step=int(done["step"]), metrics=metrics, checkpoint_path=done["checkpoint_path"]
            )
        return TrainResult(step=int(done["step"]), metrics=metrics)

    async def _experimental_pull_from_s3(self, model: Model, **_: Any) -> None:
        raise _no_s3("_experimental_pull_from_s3")

    async def _experimental_push_to_s3(self, model: Model, **_: Any) -> None:
        raise _no_s3("_experimental_push_to_s3")

    async def _experimental_pull_model_checkpoint(self, model: Model, **_: Any) -> None:
        raise _no_s3("_experimental_pull_model_checkpoint")


def _no_s3(name: str) -> UnsupportedARTSetting:
    return UnsupportedARTSetting(
        f"{name}: S3 checkpoint sync runs where the checkpoints are. A RemoteBackend's live on its server, which "
        "does not take bucket names from clients (its credentials would write where a key holder says): run "
        "LocalBackend's S3 calls, or `aws s3 sync` of `{path}/{project}/models/{name}/`, on the server host"
    )
