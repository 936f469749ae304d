"""`art_adapters.megatron` (ART's `art.megatron`): the name only; see `backend.unshipped`."""

from .backend.unshipped import MegatronBackend, UnsupportedBackendError

__all__ = ["MegatronBackend", "UnsupportedBackendError"]
