"""Messages as readable text, and trajectories without their bulky logprobs (for logs and storage)."""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)


def format_message(message: dict[str, Any]) -> str:
    """`Role:` then the content (or refusal), then one `name(arguments)` line per tool call."""
    role = str(message.get("role", "")).capitalize()
    content = message.get("content")
    if content is None:
        content = message.get("refusal")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "")
    calls = [
        f"{c['function'].get('name')}({c['function'].get('arguments')})"
        for c in message.get("tool_calls") or []
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
    ]
    if calls:
        text += ("\n" if text else "") + "\n".join(calls)
    return f"{role}:\n{text}"


def strip_logprobs(obj: Any) -> Any:
    """A deep copy of `obj` with every `logprobs` entry removed (dict keys) or set to None (object attributes).

    The original is left untouched; if it cannot be copied it is returned unchanged, with a warning.
    """
    try:
        copied = copy.deepcopy(obj)
    except Exception as error:
        # ART's words, which ported code may look for in its logs
        log.warning(
            "Failed to deepcopy object in strip_logprobs: %s. Returning original object unchanged.", error
        )
        return obj
    return _strip(copied)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "logprobs"}
    if isinstance(obj, list | tuple):
        items = [_strip(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        for key, value in list(vars(obj).items()):
            setattr(obj, key, None if key == "logprobs" else _strip(value))
    return obj
