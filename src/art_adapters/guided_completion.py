"""`art_adapters.guided_completion` (ART's path): a teacher's completion as request settings that make the student
produce exactly it (vLLM's `guided_choice`, or a forced tool call whose arguments the schema fixes), for
distillation by RL."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

from openai.types.chat import ChatCompletion


def freeze_tool_schema(tool: dict[str, Any], fixed_args: dict[str, Any]) -> dict[str, Any]:
    """A copy of the tool whose parameter schema admits only `fixed_args` (each one an enum of one value)."""
    frozen = copy.deepcopy(tool)
    frozen["function"]["parameters"] = {
        "type": "object",
        "properties": {name: {"enum": [value]} for name, value in fixed_args.items()},
        "required": list(fixed_args),
        "additionalProperties": False,
    }
    return frozen


def get_guided_completion_params(
    completion: ChatCompletion, base_tools: Iterable[dict[str, Any]] | None = None
) -> tuple[list[str] | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
    """(guided_choice, tool_choice, tools) for the student's request: the teacher's text as the only choice, or
    its first tool call forced with its arguments frozen. Pass `guided_choice` in `extra_body`."""
    message = completion.choices[0].message
    if not message.tool_calls:
        return [message.content or ""], None, None
    call = message.tool_calls[0]
    if getattr(call, "type", "function") != "function":
        raise ValueError("Only function tool calls are supported")
    if base_tools is None:
        raise ValueError("No base tools provided: the teacher called a tool, so its definition is needed")
    name = call.function.name  # type: ignore[union-attr]
    chosen = next((t for t in base_tools if t["function"]["name"] == name), None)
    if chosen is None:
        raise ValueError(f"the teacher called {name!r}, which is not among base_tools")
    try:
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    except json.JSONDecodeError as error:
        raise ValueError(f"the teacher's arguments to {name!r} are not JSON: {error}") from error
    tool_choice = {"type": "function", "function": {"name": name}}
    return None, tool_choice, [freeze_tool_schema(chosen, arguments)]


__all__ = ["freeze_tool_schema", "get_guided_completion_params"]
