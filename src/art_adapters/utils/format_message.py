"""`art_adapters.utils.format_message` (ART's path)."""

from ..formatting import format_message

__all__ = ["format_message"]
