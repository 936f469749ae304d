"""`art_adapters.utils` (ART's `art.utils`): helpers rollout code imports; the behaviour lives in `dataset`,
`decorators`, `formatting` and `paths`. Names are imported through their ART submodules, so importing a
submodule (`art_adapters.utils.retry`) never shadows the function of the same name."""

from . import output_dirs
from .format_message import format_message
from .get_model_step import get_model_step
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .log_http_errors import log_http_errors
from .retry import retry
from .strip_logprobs import strip_logprobs

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
