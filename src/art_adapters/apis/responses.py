"""The Responses API (`/v1/responses`) seen as chat completions: requests, answers and vLLM's token ids.

A captured Responses call keeps its own request and response bodies; these functions give the chat-format view
(messages, one choice, tools) that conversations, tokenization and tracing read. vLLM returns the prompt and
sampled token ids of a response when asked (`enable_response_messages`: `input_messages[].tokens`,
`output_messages[].tokens`) and logprobs of output text (`include: ["message.output_text.logprobs"]`).
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def ask_token_ids(payload: dict[str, Any]) -> dict[str, Any]:
    """The request asking vLLM for the prompt / sampled token ids and the sampled text's logprobs."""
    out = dict(payload)
    out.setdefault("enable_response_messages", True)
    include = list(out.get("include") or [])
    if LOGPROBS_INCLUDE not in include:
        include.append(LOGPROBS_INCLUDE)
    out["include"] = include
    out.setdefault("top_logprobs", 0)
    return out


def token_fields(body: dict[str, Any], *, streamed: bool = False) -> dict[str, Any]:
    """LLMCall fields of a Responses body: prompt ids, sampled ids and their logprobs (None where not known).

    vLLM attaches the logprobs of every sampled token (reasoning and tool-call tokens too) to the answer's text,
    so a list as long as the sampled ids is aligned whatever the output items. Shorter lists: a stream drops the
    logprobs of every step whose text delta is empty (the stop token; a byte in the middle of a multi-byte
    character), so a stream's list is trusted only when the stop token alone is missing; a JSON answer's tail
    can lack the stop token and a last character cut by the token limit. Anything else is unaligned: None (the
    trainer counts those tokens as `ratio_missing_tokens`), never shifted onto the wrong tokens."""
    prompt = _tokens(body.get("input_messages"), first_only=True)
    completion = _tokens(body.get("output_messages"), first_only=False)
    logprobs: list[float] = []
    for item in body.get("output") or []:
        for part in item.get("content") or [] if isinstance(item, dict) else []:
            for entry in (part.get("logprobs") or []) if isinstance(part, dict) else []:
                logprobs.append(float(entry.get("logprob")))  # type: ignore[union-attr]
    aligned: list[float] | None = None
    if completion is not None and logprobs:
        missing = len(completion) - len(logprobs)
        text_only = all(isinstance(i, dict) and i.get("type") == "message" for i in body.get("output") or [])
        stopped = body.get("status") == "completed"
        if missing == 0:
            aligned = logprobs
        elif text_only and missing > 0 and (not streamed or (missing == 1 and stopped)):
            aligned = (
                logprobs + [float("nan")] * missing
            )  # unknown tail: NaN (trained with the on-policy ratio)
    return {"prompt_token_ids": prompt, "completion_token_ids": completion, "logprobs": aligned}


def _tokens(messages: Any, *, first_only: bool) -> list[int] | None:
    if not isinstance(messages, list) or not messages:
        return None
    out: list[int] = []
    for message in messages[:1] if first_only else messages:
        tokens = message.get("tokens") if isinstance(message, dict) else None
        if not isinstance(tokens, list):
            return None
        out += [int(t) for t in tokens]
    return out


def final_response(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
    """The response object of a stream's final event (completed, incomplete or failed), and whether one came."""
    for event in reversed(events):
        if event.get("type") in _FINAL_EVENTS and isinstance(event.get("response"), dict):
            return event["response"], True
    for event in reversed(events):  # cut short: the last snapshot the server sent
        if isinstance(event.get("response"), dict):
            return event["response"], False
    return None, False


def chat_messages(request: dict[str, Any]) -> list[Message]:
    """The request's `instructions` and `input` as chat messages (tool calls and their outputs included)."""
    out: list[Message] = []
    if request.get("instructions"):
        out.append({"role": "system", "content": str(request["instructions"])})
    items = request.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items or []:
        if isinstance(item, dict):
            _append_item(out, item)
    return out


def chat_choice(response: dict[str, Any]) -> dict[str, Any] | None:
    """The response's output items as one chat choice (None for a response with no output)."""
    messages: list[Message] = []
    for item in response.get("output") or []:
        if isinstance(item, dict):
            _append_item(messages, item)
    assistant = [m for m in messages if m.get("role") == "assistant"]
    if not assistant:
        return None
    message = assistant[0]
    for extra in assistant[1:]:
        _merge(message, extra)
    message.setdefault("content", None)
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    if response.get("status") == "incomplete":
        finish = "length"
    return {"index": 0, "message": message, "finish_reason": finish}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name": ...}`) in chat form (`{"function": {...}}`)."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": function})
        elif isinstance(tool, dict):
            out.append(tool)
    return out or None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
    return "".join(parts)


def _append_item(out: list[Message], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message" or (kind is None and "role" in item):
        role = "system" if item.get("role") == "developer" else item.get("role", "user")
        message: Message = {"role": role, "content": _text(item.get("content"))}
        if role == "assistant" and out and out[-1].get("role") == "assistant" and not out[-1].get("content"):
            _merge(out[-1], message)
        else:
            out.append(message)
    elif kind == "function_call":
        call = {
            "id": str(item.get("call_id") or item.get("id") or ""),
            "type": "function",
            "function": {"name": str(item.get("name", "")), "arguments": _arguments(item.get("arguments"))},
        }
        if out and out[-1].get("role") == "assistant" and "tool_call_id" not in out[-1]:
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = (
            output
            if isinstance(output, str)
            else _text(output)
            if isinstance(output, list)
            else json.dumps(output)
        )
        out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
    elif kind == "reasoning":
        text = _text(item.get("content")) or _text(item.get("summary"))
        if text:
            out.append({"role": "assistant", "content": None, "reasoning": text})


def _merge(message: Message, extra: Message) -> None:
    if extra.get("content"):
        message["content"] = (message.get("content") or "") + extra["content"]
    if extra.get("tool_calls"):
        message.setdefault("tool_calls", []).extend(extra["tool_calls"])
    if extra.get("reasoning"):
        message["reasoning"] = (message.get("reasoning") or "") + extra["reasoning"]


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})
