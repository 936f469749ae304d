"""art-adapters: make existing LLM agents trainable with RL. ART's API: `import art_adapters as art`."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .capture import capture, current_trajectory  # eager: the subpackage has the function's name
from .config import LoRAConfig, SFTConfig, TrainConfig
from .model import Model, TrainableModel
from .trajectory import History, LLMCall, RolloutError, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from .backend.base import Backend
    from .backend.local import LocalBackend
    from .backend.remote import RemoteBackend, RemoteBackendError
    from .gather import gather_trajectories, gather_trajectory_groups
    from .ray import gather_on_ray
    from .report import write_report
    from .rewards import RulerError, ruler, ruler_score_group
    from .tracing.langfuse import LangfuseExporter
    from .tracing.wandb import WandbLogger

__version__ = "0.1.0"

# Names resolved on first use, so `import art_adapters` stays light (no httpx transport, no backend code).
_LAZY = {
    "gather_trajectory_groups": ".gather",
    "gather_trajectories": ".gather",
    "Backend": ".backend.base",
    "LocalBackend": ".backend.local",
    "RemoteBackend": ".backend.remote",
    "RemoteBackendError": ".backend.remote",
    "gather_on_ray": ".ray",
    "ruler_score_group": ".rewards",
    "ruler": ".rewards",
    "RulerError": ".rewards",
    "LangfuseExporter": ".tracing.langfuse",
    "WandbLogger": ".tracing.wandb",
    "write_report": ".report",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'art_adapters' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Backend",
    "History",
    "LLMCall",
    "LangfuseExporter",
    "LoRAConfig",
    "LocalBackend",
    "Model",
    "RemoteBackend",
    "RemoteBackendError",
    "RolloutError",
    "RulerError",
    "SFTConfig",
    "TrainConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "WandbLogger",
    "capture",
    "current_trajectory",
    "gather_trajectories",
    "gather_on_ray",
    "gather_trajectory_groups",
    "ruler",
    "ruler_score_group",
    "write_report",
]
