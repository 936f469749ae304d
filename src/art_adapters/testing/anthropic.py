"""The scripted server's Anthropic `/v1/messages` answers (JSON and streamed events), as vLLM serves that API.

No token ids: vLLM returns none on this API, so neither does the script. Usage counts follow the chat answers'
scheme (utf-8 bytes of `replies.prompt_text` of the request seen as chat messages).
"""

from __future__ import annotations

import json
from typing import Any

from ..apis.anthropic import chat_messages, chat_tools
from .replies import END, Rendered, Reply, prompt_text, render_tool_call, token_ids


def render_anthropic(request: dict[str, Any], reply: Reply, *, seq: int, model: str) -> Rendered:
    """The answer to one Messages API request."""
    base = Rendered(
        delay_s=reply.delay_s, chunk_delay_s=reply.chunk_delay_s, cut_after=reply.cut_stream_after
    )
    if reply.raw_body is not None or reply.status != 200:
        body = reply.raw_body if reply.raw_body is not None else _error(reply.status)
        data = body.encode() if isinstance(body, str) else body
        return base.model_copy(update={"status": reply.status, "body": data, "headers": dict(reply.headers)})
    calls = reply.arguments()
    content: list[dict[str, Any]] = []
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call_id, name, arguments in calls:
        content.append({"type": "tool_use", "id": call_id, "name": name, "input": _input(arguments)})
    prompt = prompt_text(chat_messages(request), chat_tools(request.get("tools")))
    sampled = (reply.content or "") + "".join(render_tool_call(name, args) for _, name, args in calls) + END
    message: dict[str, Any] = {
        "id": f"msg_scripted_{seq}",
        "type": "message",
        "role": "assistant",
        "model": request.get("model") or model,
        "content": content,
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": len(token_ids(prompt)), "output_tokens": len(token_ids(sampled))},
    }
    if not request.get("stream"):
        return base.model_copy(update={"body": json.dumps(message).encode(), "headers": dict(reply.headers)})
    headers = {"content-type": "text/event-stream", **reply.headers}
    return base.model_copy(update={"events": _events(message, reply.chunk_chars), "headers": headers})


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # a malformed call, sent as it came


def _error(status: int) -> str:
    kind = "api_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"type": "error", "error": {"type": kind, "message": f"scripted HTTP {status}"}})


def _events(message: dict[str, Any], chunk: int) -> list[bytes]:
    """message_start, each content block (start, deltas, stop), message_delta, message_stop."""
    usage = message["usage"]
    started = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": started}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            empty, text, delta = {"type": "text", "text": ""}, block["text"], "text_delta"
        else:
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            text = block["input"] if isinstance(block["input"], str) else json.dumps(block["input"])
            delta = "input_json_delta"
        events.append({"type": "content_block_start", "index": index, "content_block": empty})
        key = "text" if delta == "text_delta" else "partial_json"
        for start in range(0, len(text), chunk):
            part = {"type": delta, key: text[start : start + chunk]}
            events.append({"type": "content_block_delta", "index": index, "delta": part})
        events.append({"type": "content_block_stop", "index": index})
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(
        {"type": "message_delta", "delta": stop, "usage": {"output_tokens": usage["output_tokens"]}}
    )
    events.append({"type": "message_stop"})
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]
