"""`art_adapters.utils.limit_concurrency` (ART's path)."""

from ..decorators import limit_concurrency

__all__ = ["limit_concurrency"]
