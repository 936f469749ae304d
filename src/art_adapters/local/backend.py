"""`art_adapters.local.backend` (ART's `art.local.backend`, which its examples import): the in-process backend."""

from ..backend.local import LocalBackend

__all__ = ["LocalBackend"]
