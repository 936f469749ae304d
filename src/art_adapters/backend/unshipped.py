"""ART's backends this library does not ship: the names exist so a port fails with what to use instead."""

from __future__ import annotations

from typing import Any


class UnsupportedBackendError(RuntimeError):
    """An ART backend art-adapters does not provide."""


class _NotShipped:
    _instead = (
        "use art.LocalBackend() on a machine with the GPU, or `art-adapters serve` there and "
        "art.RemoteBackend(url, api_key) here"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedBackendError(
            f"art-adapters does not ship ART's {type(self).__name__}: {self._instead}"
        )


class ServerlessBackend(_NotShipped):
    """ART's W&B-hosted training service (not shipped)."""


class TinkerBackend(_NotShipped):
    """ART's Tinker training service backend (not shipped)."""


class TinkerNativeBackend(_NotShipped):
    """ART's native Tinker backend (not shipped)."""


class MegatronBackend(_NotShipped):
    """ART's Megatron multi-GPU backend (not shipped)."""

    _instead = (
        "art-adapters trains LoRA adapters with Unsloth/PEFT on one GPU: art.LocalBackend(), or "
        "`art-adapters serve` + art.RemoteBackend(url, api_key)"
    )


class SkyPilotBackend(_NotShipped):
    """ART's SkyPilot cluster launcher (not shipped)."""

    _instead = (
        "launch `art-adapters serve` with the SkyPilot task in integrations/gpu-host/ and connect with "
        "art.RemoteBackend(url, api_key)"
    )


class MegatronTopologyConfig(_NotShipped):
    """ART's Megatron parallel layout (not shipped: there is no Megatron backend here)."""

    _instead = MegatronBackend._instead
