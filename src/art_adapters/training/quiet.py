"""Quiet model loading: loading or saving a checkpoint is one step of a run, not lines in its log."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No transformers progress bars ("Loading weights", "Writing model shards") inside, restored after; and no
    note about optional 4-bit CPU kernels (bitsandbytes, imported by PEFT) a LoRA run never uses."""
    from transformers.utils import logging as hf_logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
