"""Scripted replies and their rendering in the exact OpenAI (+ vLLM token fields) wire format, JSON and SSE."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

END = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"


class Reply(BaseModel):
    """One scripted answer of the fake server.

    `tool_calls` items are `{"name": ..., "arguments": {...} | "raw string", "id": optional}`.
    `status != 200` answers an OpenAI error body (or `raw_body`); `raw_body` is sent verbatim (with `status`).
    `cut_stream_after=k` drops the connection after k SSE events; `empty_choices` answers `choices: []`.
    With `n > 1`, choice i > 0 answers `alternatives[i - 1]` when given, else this same reply.
    """

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    status: int = 200
    raw_body: str | bytes | None = None
    cut_stream_after: int | None = None
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    chunk_chars: int = Field(default=8, ge=1)
    empty_choices: bool = False
    alternatives: list[Reply] = Field(default_factory=list)
    headers: dict[str, str] = Field(default_factory=dict)

    def finish(self) -> str:
        if self.finish_reason is not None:
            return self.finish_reason
        return "tool_calls" if self.tool_calls else "stop"

    def arguments(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments string) of each tool call."""
        out: list[tuple[str, str, str]] = []
        for k, call in enumerate(self.tool_calls or []):
            args = call.get("arguments", {})
            text = args if isinstance(args, str) else json.dumps(args)
            out.append((str(call.get("id") or f"call_{k}"), str(call["name"]), text))
        return out


# ---- fake tokenizer: ids are the utf-8 bytes of a canonical chat rendering ----------------------------------


def render_tool_call(name: str, arguments: str) -> str:
    return f"<tool_call>{name}\n{arguments}</tool_call>"


def render_message(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    text = content or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        text += render_tool_call(str(function.get("name", "")), str(function.get("arguments", "")))
    return f"<|{message.get('role', 'user')}|>{text}{END}"


def prompt_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The rendering whose bytes are the prompt ids: a call whose messages extend the previous call's messages and
    answer gets prompt ids that extend the previous prompt + completion ids token for token."""
    head = f"<|tools|>{json.dumps(tools, sort_keys=True)}{END}" if tools else ""
    return head + "".join(render_message(m) for m in messages) + GENERATION_PROMPT


def token_ids(text: str) -> list[int]:
    return list(text.encode())


def logprob_of(token_id: int, position: int) -> float:
    """Deterministic negative logprob of a sampled token."""
    return -round(0.05 + ((token_id * 31 + position * 7) % 97) / 100.0, 4)


def logprob_entries(ids: list[int], start: int) -> list[dict[str, Any]]:
    entries = []
    for j, tid in enumerate(ids):
        token = bytes([tid]).decode("latin-1")
        lp = logprob_of(tid, start + j)
        entries.append({"token": token, "logprob": lp, "bytes": [tid], "top_logprobs": []})
    return entries


# ---- rendering --------------------------------------------------------------------------------------------------


class Rendered(BaseModel):
    """What the server sends: a status, headers and either one body or a list of SSE events."""

    status: int = 200
    headers: dict[str, str] = Field(default_factory=dict)
    body: bytes | None = None
    events: list[bytes] | None = None
    cut_after: int | None = None
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0


class ChoicePlan(BaseModel):
    index: int
    reply: Reply
    text: str
    ids: list[int]


def _plans(reply: Reply, n: int) -> list[ChoicePlan]:
    plans = []
    for i in range(n):
        r = (
            reply
            if i == 0 or not reply.alternatives
            else reply.alternatives[min(i - 1, len(reply.alternatives) - 1)]
        )
        text = (
            (r.content or "") + "".join(render_tool_call(name, args) for _, name, args in r.arguments()) + END
        )
        plans.append(ChoicePlan(index=i, reply=r, text=text, ids=token_ids(text)))
    return plans


def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    calls = reply.arguments()
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls
        ]
    return message


def error_body(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


def render_chat(request: dict[str, Any], reply: Reply, *, seq: int, model: str) -> Rendered:
    """The response to one chat-completion request."""
    base = Rendered(
        delay_s=reply.delay_s, chunk_delay_s=reply.chunk_delay_s, cut_after=reply.cut_stream_after
    )
    if reply.raw_body is not None:
        body = reply.raw_body.encode() if isinstance(reply.raw_body, str) else reply.raw_body
        return base.model_copy(update={"status": reply.status, "body": body, "headers": dict(reply.headers)})
    if reply.status != 200:
        body = error_body(reply.status, f"scripted error {reply.status}")
        return base.model_copy(update={"status": reply.status, "body": body, "headers": dict(reply.headers)})

    want_ids = bool(request.get("return_token_ids"))
    want_lp = bool(request.get("logprobs"))
    n = int(request.get("n") or 1)
    plans = [] if reply.empty_choices else _plans(reply, n)
    prompt_ids = token_ids(prompt_text(request.get("messages") or [], request.get("tools")))
    completion_tokens = sum(len(p.ids) for p in plans)
    usage = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt_ids) + completion_tokens,
    }
    head: dict[str, Any] = {
        "id": f"chatcmpl-scripted-{seq}",
        "created": int(time.time()),
        "model": request.get("model") or model,
    }
    headers = {"x-request-id": f"req-{seq}", **reply.headers}
    if not request.get("stream"):
        choices = []
        for p in plans:
            choice: dict[str, Any] = {
                "index": p.index,
                "message": _message(p.reply),
                "finish_reason": p.reply.finish(),
            }
            choice["logprobs"] = {"content": logprob_entries(p.ids, 0), "refusal": None} if want_lp else None
            if want_ids:
                choice["token_ids"] = p.ids
            choices.append(choice)
        body: dict[str, Any] = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        if want_ids:
            body["prompt_token_ids"] = prompt_ids
        return base.model_copy(update={"body": json.dumps(body).encode(), "headers": headers})
    include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
    events = list(_stream_events(head, plans, prompt_ids, usage, want_ids, want_lp, include_usage))
    return base.model_copy(
        update={"events": events, "headers": {"content-type": "text/event-stream", **headers}}
    )


def _deltas(plan: ChoicePlan) -> Iterator[tuple[dict[str, Any], str]]:
    """(delta, text whose bytes are this delta's token ids) pieces of one choice; the texts join to plan.text."""
    reply = plan.reply
    step = reply.chunk_chars
    content = reply.content or ""
    yield {"role": "assistant", "content": "", "refusal": None}, ""
    for i in range(0, len(content), step):
        yield {"content": content[i : i + step]}, content[i : i + step]
    for k, (cid, name, args) in enumerate(reply.arguments()):
        header = {"index": k, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
        pieces = [args[i : i + step] for i in range(0, len(args), step)] or [""]
        yield {"tool_calls": [header]}, f"<tool_call>{name}\n"
        for j, piece in enumerate(pieces):
            tail = "</tool_call>" if j == len(pieces) - 1 else ""
            yield {"tool_calls": [{"index": k, "function": {"arguments": piece}}]}, piece + tail


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _stream_events(
    head: dict[str, Any],
    plans: list[ChoicePlan],
    prompt_ids: list[int],
    usage: dict[str, int],
    want_ids: bool,
    want_lp: bool,
    include_usage: bool,
) -> Iterator[bytes]:
    chunk_head = {**head, "object": "chat.completion.chunk"}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    first = True
    for plan in plans:
        position = 0
        pieces = list(_deltas(plan))
        pieces.append(({}, END))
        for j, (delta, text) in enumerate(pieces):
            ids = token_ids(text)
            last = j == len(pieces) - 1
            choice: dict[str, Any] = {
                "index": plan.index,
                "delta": delta,
                "finish_reason": plan.reply.finish() if last else None,
            }
            choice["logprobs"] = (
                {"content": logprob_entries(ids, position), "refusal": None} if want_lp and ids else None
            )
            if want_ids:
                choice["token_ids"] = ids
            position += len(ids)
            chunk: dict[str, Any] = {**chunk_head, "choices": [choice], **extra}
            if first and want_ids:
                chunk["prompt_token_ids"] = prompt_ids
            first = False
            yield _sse(chunk)
    if first:  # no choices at all
        chunk = {**chunk_head, "choices": [], **extra}
        if want_ids:
            chunk["prompt_token_ids"] = prompt_ids
        yield _sse(chunk)
    if include_usage:
        yield _sse({**chunk_head, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def render_completion(request: dict[str, Any], reply: Reply, *, seq: int, model: str) -> Rendered:
    """The legacy `/v1/completions` answer (non-streamed; vLLM puts token ids on each choice)."""
    if reply.status != 200 or reply.raw_body is not None:
        return render_chat(request, reply, seq=seq, model=model)
    prompt = request.get("prompt") or ""
    prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    text = reply.content or ""
    ids = token_ids(text + END)
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reply.finish(), "logprobs": None}
    if request.get("return_token_ids"):
        choice["prompt_token_ids"] = token_ids(prompt)
        choice["token_ids"] = ids
    usage = {
        "prompt_tokens": len(prompt.encode()),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt.encode()) + len(ids),
    }
    body = {
        "id": f"cmpl-scripted-{seq}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.get("model") or model,
        "choices": [choice],
        "usage": usage,
    }
    return Rendered(body=json.dumps(body).encode(), delay_s=reply.delay_s)
