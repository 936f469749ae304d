"""`art_adapters.utils` (ART's `art.utils`): helpers rollout code imports; each lives in its own module here."""

from ..dataset import DatasetBatch, iterate_dataset
from ..decorators import limit_concurrency, log_http_errors, retry
from ..formatting import format_message, strip_logprobs
from . import output_dirs
from .get_model_step import get_model_step

__all__ = [
    "DatasetBatch",
    "format_message",
    "get_model_step",
    "iterate_dataset",
    "limit_concurrency",
    "log_http_errors",
    "output_dirs",
    "retry",
    "strip_logprobs",
]
