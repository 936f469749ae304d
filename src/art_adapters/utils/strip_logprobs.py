"""`art_adapters.utils.strip_logprobs` (ART's path)."""

from ..formatting import strip_logprobs

__all__ = ["strip_logprobs"]
