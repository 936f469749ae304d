"""`art_adapters.serverless` (ART's `art.serverless`): the name only; see `backend.unshipped`."""

from .backend.unshipped import ServerlessBackend, UnsupportedBackendError

__all__ = ["ServerlessBackend", "UnsupportedBackendError"]
