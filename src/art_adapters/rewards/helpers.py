"""Reward helpers: tolerant JSON extraction from model answers and shared-prefix splitting of conversations."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def extract_json(text: str) -> Any:
    """The JSON value in a model's answer: the whole text, a ```json fence, or the first object/array in prose.

    Leading prose, trailing text and `<think>` blocks are ignored, raw control characters inside strings allowed.
    Raises ValueError when there is none.
    """
    text = _THINK.sub("", text).strip()
    try:
        return json.loads(text, strict=False)
    except ValueError:
        pass
    for block in _FENCE.findall(text):
        try:
            return json.loads(block.strip(), strict=False)
        except ValueError:
            continue
    decoder = json.JSONDecoder(strict=False)
    found: list[Any] = []
    for match in re.finditer(r"[{\[]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
        found.append(value)
    if found:
        return found[0]
    raise ValueError("no JSON object found")


def _key(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)


def common_prefix_length(conversations: Sequence[Sequence[dict[str, Any]]]) -> int:
    """How many leading messages all conversations share (compared as canonical JSON)."""
    if not conversations:
        return 0
    keyed = [[_key(m) for m in conversation] for conversation in conversations]
    n = 0
    for column in zip(*keyed, strict=False):
        if any(item != column[0] for item in column[1:]):
            break
        n += 1
    return n


def render_messages(messages: Sequence[dict[str, Any]]) -> str:
    """One compact JSON object per line, the form the judge reads conversations in."""
    return "\n".join(json.dumps(m, ensure_ascii=False, default=str) for m in messages)
