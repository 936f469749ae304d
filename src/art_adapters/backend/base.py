"""ART's backend-first calls (`backend.train`, the S3 names) on top of the Backend protocol, which the model layer
names (`model.Backend`: what LocalBackend and RemoteBackend both do for a model) and this module re-exports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from ..compat import LocalTrainResult, TrainResult, UnsupportedARTSetting, art_backend_train_config
from ..model import Backend, InferenceEndpoint, Model, TrainableModel

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..trajectories import TrajectoryGroup

__all__ = ["ARTTraining", "Backend", "InferenceEndpoint", "Model", "TrainableModel"]


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
