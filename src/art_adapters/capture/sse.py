"""Reassemble an OpenAI-compatible SSE chat stream into the equivalent non-streamed `chat.completion` body."""

from __future__ import annotations

import json
import re
from typing import Any

# SSE ends lines with CRLF, CR or LF only (str.splitlines would also split on U+2028, U+2029, U+0085, \x0b,
# \x0c, \x1c-\x1e, which JSON strings may carry raw).
_LINE_END = re.compile(r"\r\n|\r|\n")


def parse_events(raw: bytes) -> tuple[list[dict[str, Any]], bool, str | None]:
    """The JSON `data:` payloads of a stream, whether `[DONE]` arrived, and the first error seen (bad JSON or an
    `{"error": ...}` event)."""
    events: list[dict[str, Any]] = []
    done = False
    error: str | None = None
    data: list[str] = []
    text = raw.decode("utf-8", errors="replace")
    for line in _LINE_END.split(text):
        if line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
            continue
        if line or not data:
            continue
        done, error = _flush(data, events, done, error)
        data = []
    if data:
        done, error = _flush(data, events, done, error)
    return events, done, error


def _flush(
    data: list[str], events: list[dict[str, Any]], done: bool, error: str | None
) -> tuple[bool, str | None]:
    payload = "\n".join(data)
    if payload.strip() == "[DONE]":
        return True, error
    try:
        event = json.loads(payload)
    except ValueError:
        return done, error or f"invalid JSON in stream event: {payload[:200]!r}"
    if isinstance(event, dict):
        if "error" in event and "choices" not in event:
            error = error or f"error event: {json.dumps(event['error'])[:1000]}"
        events.append(event)
    return done, error


class _ChoiceState:
    __slots__ = (
        "index",
        "role",
        "content",
        "refusal",
        "reasoning",
        "tools",
        "finish",
        "logprobs",
        "token_ids",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.logprobs: list[dict[str, Any]] | None = None
        self.token_ids: list[int] | None = None

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("role"):
            self.role = delta["role"]
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("refusal"):
            self.refusal.append(delta["refusal"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            self.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or []:
            slot = self.tools.setdefault(
                int(call.get("index", len(self.tools))),
                {"id": None, "type": "function", "name": "", "args": []},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            name = function.get("name")
            if name and name != slot["name"]:  # some servers repeat the whole name in every delta
                slot["name"] += name
            if function.get("arguments"):
                slot["args"].append(function["arguments"])
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            self.logprobs = (self.logprobs or []) + logprobs["content"]
        ids = choice.get("token_ids")
        if ids:
            self.token_ids = (self.token_ids or []) + list(ids)

    def build(self) -> dict[str, Any]:
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": self.role,
            "content": content if content or not self.tools else None,
        }
        message["refusal"] = "".join(self.refusal) or None
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tools:
            message["tool_calls"] = [
                {
                    "id": slot["id"],
                    "type": slot["type"],
                    "function": {"name": slot["name"], "arguments": "".join(slot["args"])},
                }
                for _, slot in sorted(self.tools.items())
            ]
        out: dict[str, Any] = {
            "index": self.index,
            "message": message,
            "finish_reason": self.finish,
            "logprobs": {"content": self.logprobs, "refusal": None} if self.logprobs is not None else None,
        }
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        return out


def reassemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The `chat.completion` body equivalent to the chunks (content and tool-call fragments joined by index)."""
    states: dict[int, _ChoiceState] = {}
    body: dict[str, Any] = {"object": "chat.completion"}
    for event in events:
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if key not in body and event.get(key) is not None:
                body[key] = event[key]
        if event.get("usage"):
            body["usage"] = event["usage"]
        if "prompt_token_ids" not in body and event.get("prompt_token_ids") is not None:
            body["prompt_token_ids"] = event["prompt_token_ids"]
        for choice in event.get("choices") or []:
            index = int(choice.get("index", 0))
            state = states.get(index)
            if state is None:
                state = states[index] = _ChoiceState(index)
            state.add(choice)
    body["choices"] = [states[i].build() for i in sorted(states)]
    body.setdefault("usage", None)
    return body
