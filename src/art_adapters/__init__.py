"""art-adapters: make existing LLM agents trainable with RL. ART's API: `import art_adapters as art`."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .config import LoRAConfig, SFTConfig, TrainConfig
from .model import Model, TrainableModel
from .trajectory import History, LLMCall, RolloutError, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from .backend.base import Backend
    from .backend.local import LocalBackend
    from .backend.remote import RemoteBackend
    from .capture import capture, current_trajectory
    from .gather import gather_trajectories, gather_trajectory_groups

__version__ = "0.1.0"

# Names resolved on first use, so `import art_adapters` stays light (no httpx transport, no backend code).
_LAZY = {
    "capture": ".capture",
    "current_trajectory": ".capture",
    "gather_trajectory_groups": ".gather",
    "gather_trajectories": ".gather",
    "Backend": ".backend.base",
    "LocalBackend": ".backend.local",
    "RemoteBackend": ".backend.remote",
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
    "LoRAConfig",
    "LocalBackend",
    "Model",
    "RemoteBackend",
    "RolloutError",
    "SFTConfig",
    "TrainConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "capture",
    "current_trajectory",
    "gather_trajectories",
    "gather_trajectory_groups",
]
