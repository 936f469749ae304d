"""What the framework modules share: the tool every agent gets, the texts the steered model says, and a reading of
requests (chat completions or Responses) that the steering scripts decide on. Imports no framework."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

QUESTION = "What is the weather in Oslo?"


def question(k: int) -> str:
    """Rollout k's question: its marker shows that every call of a rollout landed in that rollout."""
    return f"{QUESTION} (rollout {k})"


def rollout_of(body: dict[str, Any]) -> str:
    """The marker of the rollout a request belongs to (for scripts that pass it on, e.g. to a sub-agent)."""
    found = re.search(r"rollout (\d+)", json.dumps(body))
    return f"(rollout {found.group(1)})" if found else ""


WEATHER = "3C, rain"
ANSWER = "Oslo: 3C and rain."


def get_weather(city: str) -> str:
    """The weather in a city."""
    return WEATHER


def call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """A tool call as Qwen's templates write it (vLLM's hermes parser reads it back)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}\n</tool_call>'


@dataclass
class Endpoint:
    """Where a rollout's agent sends its requests."""

    base_url: str
    api_key: str
    model: str


def tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        names.append(function.get("name", ""))
    return names


def turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's history as chat messages (`role`, `content` text, `name`), Responses items included."""
    if "messages" in body:
        out = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append({**m, "content": content or ""})
        return out
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    for item in items or []:
        kind = item.get("type", "message")
        if kind == "function_call_output":
            out.append({"role": "tool", "content": str(item.get("output", ""))})
        elif kind == "function_call":
            out.append(
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": item["name"]}}]}
            )
        else:
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append({"role": item.get("role", "user"), "content": content or ""})
    return out


def since_last_user(body: dict[str, Any]) -> list[dict[str, Any]]:
    history = turns(body)
    last = max((i for i, m in enumerate(history) if m["role"] == "user"), default=-1)
    return history[last + 1 :]


def called(body: dict[str, Any], tool: str) -> bool:
    """Whether `tool` was already called since the last user message."""
    for message in since_last_user(body):
        for tool_call in message.get("tool_calls") or []:
            if (tool_call.get("function") or {}).get("name") == tool:
                return True
    return False


def react(body: dict[str, Any], tool: str = "get_weather", arguments: dict[str, Any] | None = None) -> str:
    """Call `tool` once, then answer: what a single tool-using agent does."""
    if tool in tool_names(body) and not called(body, tool):
        return call(tool, arguments if arguments is not None else {"city": "Oslo"})
    return ANSWER
