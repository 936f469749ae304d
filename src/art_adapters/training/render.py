"""How vLLM renders a conversation into prompt ids: the chat template over messages as vLLM hands them to it."""

from __future__ import annotations

import json
from typing import Any, Protocol

from ..trajectories import Message, Tools


class ChatTokenizer(Protocol):
    """What we need of a Hugging Face tokenizer."""

    def __len__(self) -> int: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def chat_template_ids(
    tokenizer: ChatTokenizer,
    messages: list[Message],
    tools: Tools | None,
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Prompt ids of `messages` (+ tools), with the generation prompt by default, as vLLM renders them
    (`template_kwargs`: a request's `chat_template_kwargs`, such as Qwen3's `enable_thinking`)."""
    out = tokenizer.apply_chat_template(
        as_vllm_renders(messages),
        tools=tools or None,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **template_kwargs,
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def as_vllm_renders(messages: list[Message]) -> list[Message]:
    """Messages as vLLM hands them to the chat template: tool-call `arguments` parsed from JSON into a dict, and
    anything that is not a JSON object (null, "", malformed, a list) rendered as `{}`; reasoning as below."""
    out: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_with_parsed_arguments(call) for call in calls]}
        if message.get("role") == "assistant" and ("reasoning" in message or "reasoning_content" in message):
            # vLLM reads an assistant turn's reasoning from `reasoning` only and hands it to the template as both
            # names; a `reasoning_content` the client sends is not rendered.
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
            if message.get("reasoning") is not None:
                message["reasoning_content"] = message["reasoning"]
        out.append(message)
    return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}
