"""`art_adapters.dev` (ART's `art.dev`): the `_config=` / `_internal_config=` shapes, mapped in `compat`."""

from ..compat import DevTrainConfig as TrainConfig
from ..compat import DevTrainSFTConfig as TrainSFTConfig
from ..compat import (
    EngineArgs,
    InitArgs,
    InternalModelConfig,
    OpenAIServerConfig,
    ServerArgs,
    TrainerArgs,
)
from ..config import LoRAConfig

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "OpenAIServerConfig",
    "ServerArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
]
