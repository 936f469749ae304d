"""The recording client: httpx transports that record OpenAI-compatible calls into the current capture scope."""

from .scope import capture, current_trajectory, reward_call
from .transport import AsyncRecordingTransport, RecordingTransport

__all__ = ["AsyncRecordingTransport", "RecordingTransport", "capture", "current_trajectory", "reward_call"]
