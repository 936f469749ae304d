"""The scripted server's `/v1/responses` answers (JSON and streamed events), with vLLM's token-id extras.

Ids follow the chat answers' scheme (utf-8 bytes of `replies.prompt_text` of the request seen as chat messages),
so a Responses call that extends the previous one extends its ids too. `enable_response_messages` adds vLLM's
`input_messages` / `output_messages` (the raw prompt and output with their tokens); the output text carries
logprobs when `include` asks for them (vLLM gives none for function calls, and none for the stop token).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..apis.responses import LOGPROBS_INCLUDE, chat_messages, chat_tools
from .replies import END, Rendered, Reply, logprob_entries, prompt_text, render_tool_call, token_ids


def render_response(request: dict[str, Any], reply: Reply, *, seq: int, model: str) -> Rendered:
    """The answer to one Responses API request."""
    if reply.status != 200 or reply.raw_body is not None:
        from .replies import render_chat

        return render_chat(request, reply, seq=seq, model=model)
    prompt = prompt_text(chat_messages(request), chat_tools(request.get("tools")))
    prompt_ids = token_ids(prompt)
    calls = reply.arguments()
    text = (reply.content or "") + "".join(render_tool_call(name, args) for _, name, args in calls) + END
    ids = token_ids(text)
    want_logprobs = LOGPROBS_INCLUDE in (request.get("include") or [])
    output: list[dict[str, Any]] = []
    if reply.content:
        part: dict[str, Any] = {"type": "output_text", "text": reply.content, "annotations": []}
        if want_logprobs and not calls:  # like vLLM: the text's tokens, not the stop token's
            part["logprobs"] = logprob_entries(ids[:-1], 0)
        output.append(
            {
                "id": f"msg_{seq}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        )
    for k, (call_id, name, arguments) in enumerate(calls):
        output.append(
            {
                "id": f"fc_{seq}_{k}",
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    response: dict[str, Any] = {
        "id": f"resp_scripted_{seq}",
        "object": "response",
        "created_at": int(time.time()),
        "model": request.get("model") or model,
        "status": "completed",
        "output": output,
        "instructions": request.get("instructions"),
        "tools": request.get("tools") or [],
        "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": True,
        "temperature": request.get("temperature", 1.0),
        "top_p": request.get("top_p", 1.0),
        "metadata": {},
        "incomplete_details": None,
        "error": None,
        "usage": {
            "input_tokens": len(prompt_ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(prompt_ids) + len(ids),
        },
    }
    if request.get("enable_response_messages"):
        response["input_messages"] = [{"message": prompt, "tokens": prompt_ids, "type": "raw_message_tokens"}]
        response["output_messages"] = [{"message": text, "tokens": ids, "type": "raw_message_tokens"}]
    base = Rendered(
        delay_s=reply.delay_s, chunk_delay_s=reply.chunk_delay_s, cut_after=reply.cut_stream_after
    )
    if not request.get("stream"):
        return base.model_copy(update={"body": json.dumps(response).encode()})
    return base.model_copy(
        update={"events": _events(response, reply), "headers": {"content-type": "text/event-stream"}}
    )


def _events(response: dict[str, Any], reply: Reply) -> list[bytes]:
    """The stream: created, each output item added / deltas / done, then completed (no `[DONE]`, as OpenAI)."""
    events: list[dict[str, Any]] = []
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    for key in ("input_messages", "output_messages"):
        started.pop(key, None)
    events.append({"type": "response.created", "response": started})
    for index, item in enumerate(response["output"]):
        empty = {**item, "status": "in_progress"}
        if item["type"] == "message":
            empty["content"] = []
        else:
            empty["arguments"] = ""
        events.append({"type": "response.output_item.added", "output_index": index, "item": empty})
        if item["type"] == "message":
            text = item["content"][0]["text"]
            for start in range(0, len(text), reply.chunk_chars):
                events.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": text[start : start + reply.chunk_chars],
                        "logprobs": [],
                    }
                )
            events.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                }
            )
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    out = []
    for number, event in enumerate(events):
        event["sequence_number"] = number
        out.append(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    return out
