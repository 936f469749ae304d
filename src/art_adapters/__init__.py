"""art-adapters: make existing LLM agents trainable with RL. ART's API: `import art_adapters as art`."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .adapters.rollout_scope import (
    SCOPES,
    auto_trajectory,
    capture_auto_trajectory,
    capture_yielded_trajectory,
    current_trajectory_group,
    trajectory,
    trajectory_group,
    yield_trajectory,
)
from .agent_adapters import PerAgent, UnsupportedPerAgentSetting
from .capture import capture, current_trajectory, reward_call  # eager: the subpackage has the function's name
from .compat import LocalTrainResult, ServerlessTrainResult, TrainResult, UnsupportedARTSetting
from .config import LoRAConfig, SFTConfig, ShardedTrainerOptions, TrainConfig, TrainSFTConfig
from .decorators import retry
from .model import Model, TrainableModel
from .sources import CallSource, role
from .tokenized import (
    TokenFlag,
    TokenizedHistory,
    TokenizedMultiHistoryTrajectory,
    TokenizedTrajectory,
    TokenizedTrajectoryGroup,
    provide_history_tokenizer,
)
from .trajectories import (
    History,
    LegacyHistory,
    LLMCall,
    Messages,
    MessagesAndChoices,
    PydanticException,
    RolloutError,
    Tools,
    Trajectory,
    TrajectoryGroup,
    provide_rollout_scopes,
)

if TYPE_CHECKING:
    from . import dev
    from .backend.base import Backend
    from .backend.local import LocalBackend
    from .backend.remote import RemoteBackend, RemoteBackendError
    from .backend.unshipped import (
        MegatronBackend,
        MegatronTopologyConfig,
        ServerlessBackend,
        SkyPilotBackend,
        TinkerBackend,
        TinkerNativeBackend,
        UnsupportedBackendError,
    )
    from .evaluation.harness import evaluate
    from .evaluation.periodic import Evaluation
    from .gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
    from .pipeline_tuner import PipelineRuntimeConfig
    from .ray import gather_on_ray
    from .report import write_report
    from .rewards import RulerError, ruler, ruler_score_group, ruler_score_turns
    from .tracing.langfuse import LangfuseExporter
    from .tracing.wandb import WandbLogger

provide_rollout_scopes(
    SCOPES
)  # `with art.Trajectory()`, `await art.TrajectoryGroup(...)`: the composition root


def _tokenize_source(source: Any, **options: Any) -> list[TokenizedHistory]:
    """`Trajectory.tokenize()`'s implementation, imported on first use (it renders with the training layer)."""
    from .training.art_tokenize import tokenize_source

    return tokenize_source(source, **options)


provide_history_tokenizer(_tokenize_source)

__version__ = "0.1.0"

# Names resolved on first use, so `import art_adapters` stays light (no httpx transport, no backend code).
_LAZY = {
    "gather_trajectory_groups": ".gather",
    "gather_trajectories": ".gather",
    "trajectory_group_batches": ".gather",
    "Backend": ".backend.base",
    "LocalBackend": ".backend.local",
    "RemoteBackend": ".backend.remote",
    "RemoteBackendError": ".backend.remote",
    "ServerlessBackend": ".backend.unshipped",
    "TinkerBackend": ".backend.unshipped",
    "TinkerNativeBackend": ".backend.unshipped",
    "MegatronBackend": ".backend.unshipped",
    "SkyPilotBackend": ".backend.unshipped",
    "MegatronTopologyConfig": ".backend.unshipped",
    "UnsupportedBackendError": ".backend.unshipped",
    "gather_on_ray": ".ray",
    "ruler_score_group": ".rewards",
    "ruler_score_turns": ".rewards",
    "ruler": ".rewards",
    "RulerError": ".rewards",
    "LangfuseExporter": ".tracing.langfuse",
    "WandbLogger": ".tracing.wandb",
    "write_report": ".report",
    "RecordingEndpoint": ".capture.endpoint",
    "LiveRecorder": ".capture.live",
    "open_store": ".store",
    "OTLPEndpoint": ".tracing.otlp_endpoint",
    "PipelineRuntimeConfig": ".pipeline_tuner",
    "evaluate": ".evaluation.harness",
    "Evaluation": ".evaluation.periodic",
}


def __getattr__(name: str) -> Any:
    if name == "dev":
        return import_module(".dev", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'art_adapters' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "LegacyHistory",
    "TokenFlag",
    "TokenizedHistory",
    "TokenizedMultiHistoryTrajectory",
    "TokenizedTrajectory",
    "TokenizedTrajectoryGroup",
    "CallSource",
    "role",
    "Backend",
    "History",
    "LLMCall",
    "LangfuseExporter",
    "LoRAConfig",
    "LocalBackend",
    "LocalTrainResult",
    "MegatronBackend",
    "MegatronTopologyConfig",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "PipelineRuntimeConfig",
    "PydanticException",
    "RemoteBackend",
    "RemoteBackendError",
    "RolloutError",
    "RulerError",
    "SFTConfig",
    "ServerlessBackend",
    "ServerlessTrainResult",
    "ShardedTrainerOptions",
    "SkyPilotBackend",
    "TinkerBackend",
    "TinkerNativeBackend",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "PerAgent",
    "UnsupportedPerAgentSetting",
    "Trajectory",
    "TrajectoryGroup",
    "UnsupportedARTSetting",
    "UnsupportedBackendError",
    "WandbLogger",
    "auto_trajectory",
    "capture",
    "capture_auto_trajectory",
    "capture_yielded_trajectory",
    "current_trajectory",
    "current_trajectory_group",
    "dev",
    "gather_on_ray",
    "gather_trajectories",
    "gather_trajectory_groups",
    "retry",
    "ruler",
    "ruler_score_group",
    "ruler_score_turns",
    "reward_call",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "write_report",
    "evaluate",
    "Evaluation",
    "RecordingEndpoint",
    "LiveRecorder",
    "open_store",
    "OTLPEndpoint",
    "yield_trajectory",
]
