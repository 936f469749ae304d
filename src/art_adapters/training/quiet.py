"""Quiet model loading: loading or saving a checkpoint is one step of a run, not lines in its log."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# Import-time notes of optional kernels a LoRA step never uses: bitsandbytes' 4-bit CPU kernels (imported by
# PEFT), torchao's CUDA extensions that fail to load on CPU, torch's deprecation of torchao's enum registration.
_IMPORT_NOTES = ("bitsandbytes", "torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_import_notes() -> Iterator[None]:
    """Inside: those loggers at ERROR (the notes are logged while the libraries import); their levels restored
    after. Wrap the first import of PEFT / torchao / a transformers model class."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOTES]
    previous = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in previous:
            logger.setLevel(level)


@contextlib.contextmanager
def quiet_loading(*, unsloth: bool = False) -> Iterator[None]:
    """No transformers progress bars ("Loading weights", "Writing model shards") and no import-time kernel notes
    inside; every level restored after. `unsloth`: the loading inside uses Unsloth, which must be imported before
    transformers (it patches it; imported after, it warns and may run slower), so it is imported first here."""
    with quiet_import_notes():
        if unsloth:
            _import_unsloth_first()
        from transformers.utils import logging as hf_logging

        enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if enabled:
                hf_logging.enable_progress_bar()


def _import_unsloth_first() -> None:
    """Import Unsloth before transformers is (ImportError is left to the loader, which reports it)."""
    import sys

    if "unsloth" in sys.modules:
        return
    from ..devices import noting_import_settings

    with noting_import_settings(), contextlib.suppress(ImportError):
        import unsloth  # noqa: F401
