"""`art_adapters.utils.retry` (ART's path)."""

from ..decorators import retry

__all__ = ["retry"]
