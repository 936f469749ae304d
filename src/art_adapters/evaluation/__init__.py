"""Did training help? The evaluation harness: the user's own rollout over scenarios x attempts x steps, with
bootstrap intervals, unbiased pass@k and paired comparisons between steps (docs/evaluation.md)."""

from typing import Any as _Any

_NAMES = {
    "evaluate": ".harness",
    "Sampling": ".harness",
    "EvaluationError": ".harness",
    "Reference": ".targets",
    "EvalResult": ".results",
    "Attempt": ".results",
    "Evaluation": ".periodic",
}


def __getattr__(name: str) -> _Any:
    from importlib import import_module

    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'art_adapters.evaluation' has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)
