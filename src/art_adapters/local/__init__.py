"""`art_adapters.local` (ART's `art.local`): the in-process backend."""

from ..backend.local import LocalBackend

__all__ = ["LocalBackend"]
