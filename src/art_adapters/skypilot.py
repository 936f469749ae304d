"""`art_adapters.skypilot` (ART's `art.skypilot`): the name only; see `backend.unshipped`."""

from .backend.unshipped import SkyPilotBackend, UnsupportedBackendError

__all__ = ["SkyPilotBackend", "UnsupportedBackendError"]
