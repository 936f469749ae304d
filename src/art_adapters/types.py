"""`art_adapters.types` (ART's `art.types`): the type names ART code imports from there, defined elsewhere here."""

from __future__ import annotations

from typing import Literal

from .calls import Message, Tools
from .compat import LocalTrainResult, ServerlessTrainResult, TrainResult
from .config import SFTConfig, TrainConfig, TrainSFTConfig
from .trajectories import MessageOrChoice, Messages, MessagesAndChoices

Verbosity = Literal[0, 1, 2]

__all__ = [
    "LocalTrainResult",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "SFTConfig",
    "ServerlessTrainResult",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "Verbosity",
]
