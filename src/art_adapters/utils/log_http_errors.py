"""`art_adapters.utils.log_http_errors` (ART's path)."""

from ..decorators import log_http_errors

__all__ = ["log_http_errors"]
