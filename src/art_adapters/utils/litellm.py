"""`art_adapters.utils.litellm` (ART's path): a LiteLLM completion's choice as an openai `Choice`, for rollouts
that call `litellm.acompletion(**model.litellm_completion_params())` and append the choice to a trajectory."""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice


def convert_litellm_choice_to_openai(choice: Any) -> Choice:
    """The choice (LiteLLM's `Choices`, or its dict) as an openai Choice: message, tool calls, finish reason and
    logprobs kept, with any token extras a vLLM server returned (`token_ids`, `prompt_token_ids`)."""
    data = choice.model_dump() if hasattr(choice, "model_dump") else dict(choice)
    message = dict(data.get("message") or {})
    message.setdefault("role", "assistant")
    message = {k: v for k, v in message.items() if v is not None or k == "content"}
    for call in message.get("tool_calls") or []:
        call.setdefault("type", "function")
    logprobs = data.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, dict):
        logprobs = logprobs.model_dump() if hasattr(logprobs, "model_dump") else None
    out = {
        **{k: v for k, v in data.items() if k not in ("message", "logprobs")},
        "index": data.get("index", 0),
        "finish_reason": data.get("finish_reason") or "stop",
        "message": message,
        "logprobs": logprobs,
    }
    return Choice.model_validate(out)


__all__ = ["convert_litellm_choice_to_openai"]
