"""Trace sinks for finished trajectories: Langfuse (`LangfuseExporter`) and Weights & Biases (`WandbLogger`).

Both import their SDK only when an exporter/logger is made, so `import art_adapters.tracing` stays light.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .langfuse import LangfuseExporter
    from .wandb import WandbLogger

_LAZY = {"LangfuseExporter": ".langfuse", "WandbLogger": ".wandb"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'art_adapters.tracing' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = ["LangfuseExporter", "WandbLogger"]
