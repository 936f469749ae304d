"""Anthropic's Messages API (`/v1/messages`, which vLLM also serves) seen as chat completions.

A captured Messages call keeps its own request and response bodies; these functions give the chat-format view
(messages, one choice, tools) that conversations, tracing and the report read, and rebuild a streamed answer from
its events. vLLM returns no token ids on this API, so its calls carry text only: they train only when the user
opts in to re-tokenized text (`TrainConfig(train_retokenized_text=True)`).
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def final_message(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
    """The message a stream's events build (`message_start`, content block starts and deltas, `message_delta`),
    and whether its `message_stop` came."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}
    done = False
    for event in events:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            message = {**event["message"], "content": []}
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            blocks[int(event.get("index", len(blocks)))] = dict(event["content_block"])
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            index = int(event.get("index", 0))
            _apply_delta(
                blocks.setdefault(index, {"type": "text", "text": ""}), event["delta"], partial_json, index
            )
        elif kind == "message_delta" and message is not None:
            message.update({k: v for k, v in (event.get("delta") or {}).items() if v is not None})
            if isinstance(event.get("usage"), dict):
                message["usage"] = {**(message.get("usage") or {}), **event["usage"]}
        elif kind == "message_stop":
            done = True
    if message is None:
        return None, False
    for index, text in partial_json.items():
        try:
            blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            blocks[index]["input"] = text  # a cut stream: the text as it came
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message, done


def _apply_delta(block: dict[str, Any], delta: dict[str, Any], partial: dict[int, str], index: int) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + str(delta.get("text", ""))
    elif kind == "input_json_delta":
        partial[index] = partial.get(index, "") + str(delta.get("partial_json", ""))
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
    elif kind == "signature_delta":
        block["signature"] = str(delta.get("signature", ""))


def chat_messages(request: dict[str, Any]) -> list[Message]:
    """The request's `system` and `messages` as chat messages (tool uses and their results included)."""
    out: list[Message] = []
    system = _text(request.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for message in request.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role", "user")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "assistant":
            out.append(_assistant(content or []))
        else:
            _append_user(out, content or [])
    return out


def chat_choice(response: dict[str, Any]) -> dict[str, Any] | None:
    """The response's content blocks as one chat choice (None when it has no content list)."""
    content = response.get("content")
    if not isinstance(content, list):
        return None
    finish = _FINISH.get(str(response.get("stop_reason")), "stop")
    return {"index": 0, "message": _assistant(content), "finish_reason": finish}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Client tools (`{"name", "description", "input_schema"}`) in chat form; the server's own tools
    (web search ...) as they are."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and "input_schema" in tool and tool.get("type") in (None, "custom"):
            function = {"name": tool.get("name", "")}  # vLLM's order: the template dumps this JSON as it is
            if tool.get("description"):
                function["description"] = tool["description"]
            function["parameters"] = tool["input_schema"]
            out.append({"type": "function", "function": function})
        elif isinstance(tool, dict):
            out.append(tool)
    return out or None


def _assistant(blocks: list[Any]) -> Message:
    message: Message = {"role": "assistant", "content": None}
    texts: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = block.get("input")
            call = {
                "id": str(block.get("id", "")),
                "type": "function",
                "function": {
                    "name": str(block.get("name", "")),
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments or {}),
                },
            }
            message.setdefault("tool_calls", []).append(call)
        elif kind == "thinking" and block.get("thinking"):
            message["reasoning"] = message.get("reasoning", "") + str(block["thinking"])
    if texts:
        message["content"] = "".join(texts)
    return message


def _append_user(out: list[Message], blocks: list[Any]) -> None:
    """A user turn's blocks in order: each tool result a tool message, the rest of the text one user message."""
    texts: list[str] = []
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            text = _text(block.get("content"), "\n")  # vLLM joins a result's text blocks by lines
            if block.get("is_error") and not text:
                text = "error"
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif block.get("type") == "text":
            texts.append(str(block.get("text", "")))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})


def _text(content: Any, separator: str = "") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return separator.join(
        str(block.get("text", ""))
        for block in content
        if isinstance(block, dict) and block.get("type") == "text"
    )
