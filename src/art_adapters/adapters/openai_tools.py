"""Plain OpenAI tool loops: `wrap_rollout` captures the clients the rollout builds; `run_tool_loop` runs the tools."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..envs.base import ToolFn, ToolSet, call_tool
from .base import wrap_rollout

if TYPE_CHECKING:
    from ..model import Model

__all__ = ["ToolLoopResult", "run_tool_loop", "wrap_rollout"]

# `reasoning` (vLLM's name for a reasoning model's thinking) goes back with the turn: templates such as Qwen3's
# keep it for the turns after the last user query, so the next prompt continues the sampled tokens.
_ASSISTANT_KEYS = ("role", "content", "reasoning", "tool_calls", "refusal")


@dataclass
class ToolLoopResult:
    """What a tool loop ended with: the whole conversation, the final text, and how it got there."""

    messages: list[dict[str, Any]]
    final: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str | None = None
    responses: list[Any] = field(default_factory=list)


def _functions(functions: ToolSet | Mapping[str, ToolFn] | Iterable[ToolFn] | None) -> dict[str, ToolFn]:
    if functions is None:
        return {}
    if isinstance(functions, ToolSet):
        return functions.functions
    if isinstance(functions, Mapping):
        return dict(functions)
    return {fn.__name__: fn for fn in functions}


def _assistant_message(message: Any) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    out = {k: data[k] for k in _ASSISTANT_KEYS if k in data}
    out["role"] = "assistant"
    out.setdefault("content", None)
    return out


async def run_tool_loop(
    client: Any,
    model: Model | str,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    functions: ToolSet | Mapping[str, ToolFn] | Iterable[ToolFn] | None = None,
    max_turns: int = 8,
    *,
    on_turn: Callable[[ToolLoopResult], Any] | None = None,
    **create_kwargs: Any,
) -> ToolLoopResult:
    """Ask the model, run the tools it calls (in parallel when it calls several), repeat until it answers.

    `client` is an `openai.AsyncOpenAI` or `openai.OpenAI` (a sync client runs in a worker thread with this
    context, so capture sees it). A malformed tool call (bad JSON, unknown tool, wrong arguments, a tool that
    raises) goes back to the model as the `tool` message `Error: ...`; the loop never crashes on one.
    """
    names = _functions(functions)
    if tools is None and isinstance(functions, ToolSet):
        tools = functions.schemas
    name = model if isinstance(model, str) else model.get_inference_name()
    result = ToolLoopResult(messages=[dict(m) for m in messages])
    create = client.chat.completions.create
    is_async = _is_async(client, create)
    if tools:
        create_kwargs.setdefault("tools", list(tools))
    for _ in range(max_turns):
        if is_async:
            response = await create(model=name, messages=result.messages, **create_kwargs)
        else:
            response = await asyncio.to_thread(create, model=name, messages=result.messages, **create_kwargs)
        result.turns += 1
        result.responses.append(response)
        choice = response.choices[0]
        result.finish_reason = choice.finish_reason
        assistant = _assistant_message(choice.message)
        result.messages.append(assistant)
        calls = assistant.get("tool_calls") or []
        if not calls:
            result.final = assistant.get("content")
            break
        outputs = await asyncio.gather(*(_run_call(names, call) for call in calls))
        for call, output in zip(calls, outputs, strict=True):
            result.tool_calls += 1
            result.tool_errors += output.startswith("Error:")
            result.messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
        if on_turn is not None:
            maybe = on_turn(result)
            if inspect.isawaitable(maybe):
                await maybe
    return result


def _is_async(client: Any, create: Any) -> bool:
    import openai

    return isinstance(client, openai.AsyncOpenAI) or inspect.iscoroutinefunction(inspect.unwrap(create))


async def _run_call(functions: Mapping[str, ToolFn], call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    return await call_tool(functions, str(function.get("name", "")), function.get("arguments"))
