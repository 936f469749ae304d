"""`art_adapters.tinker` (ART's `art.tinker`): the names only; see `backend.unshipped`."""

from .backend.unshipped import TinkerBackend, TinkerNativeBackend, UnsupportedBackendError

__all__ = ["TinkerBackend", "TinkerNativeBackend", "UnsupportedBackendError"]
