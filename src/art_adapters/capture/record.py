"""One exchange in flight: the bytes seen so far, turned into an `LLMCall` (parsed once, at the end) and stored."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from ..apis.anthropic import final_message
from ..apis.responses import final_response, token_fields
from ..calls import SERVED_HEADER, VERSION_HEADER
from ..trajectories import LLMCall, SampledChoice, Trajectory
from ..untrusted import parse_step
from .frameworks import source_of_context, with_handoffs
from .sse import parse_events, reassemble

log = logging.getLogger(__name__)

try:  # optional: ~3x faster parsing on the recording path; same values, ValueError on bad JSON
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads


class Exchange:
    """The recording of one request: created before sending, finished once when the body ends, fails or closes."""

    __slots__ = (
        "trajectory",
        "request_body",
        "request_json",
        "url",
        "started_at",
        "t0",
        "status",
        "headers",
        "chunks",
        "decoded",
        "done",
        "logprobs_mode",
        "source",
        "kind",
    )

    def __init__(
        self,
        trajectory: Trajectory,
        request: httpx.Request,
        body: bytes,
        payload: dict[str, Any] | None,
        logprobs_mode: str | None,
        kind: str = "chat",
    ) -> None:
        self.trajectory = trajectory
        self.request_body = body
        self.request_json = payload
        self.url = request.url
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.chunks: list[bytes] = []
        self.decoded = False
        self.done = False
        self.logprobs_mode = logprobs_mode
        self.kind = kind
        self.source = source_of_context()  # read here: this runs in the task that sends the request

    def finish(
        self,
        error: BaseException | str | None = None,
        *,
        early: bool = False,
        body: dict[str, Any] | None = None,
    ) -> None:
        """Build the LLMCall and add it to the trajectory (first call wins; later ones are no-ops).

        `early`: the caller closed the response; an error only if the body had not ended. `body`: already parsed.
        """
        if self.done:
            return
        self.done = True
        if self.trajectory._sealed:
            log.warning(
                "a call to %s ended after its capture scope closed; not added to the finished trajectory",
                self.url,
            )
            return
        latency = time.perf_counter() - self.t0
        request = self.request_json
        if request is None:
            try:
                request = _loads(self.request_body)
            except ValueError:
                request = None
            if not isinstance(request, dict):
                request = {"_raw": self.request_body.decode("utf-8", errors="replace")}
        message = _describe(error) if error is not None else None
        seen = _header_values(self.headers)
        fields: dict[str, Any] = {}
        if self.status is not None:
            if body is None:
                body, message = self._parse(message, early, bool(request.get("stream")), seen)
            if body is not None:
                fields = _FIELDS.get(self.kind, body_fields)(body, bool(request.get("stream")))
        source = self.source
        if source.framework == "openai_agents":  # the agents that held the run before: from earlier calls
            source = with_handoffs(source, [c.source for c in self.trajectory.llm_calls])
        call = LLMCall(
            request=request,
            url=str(self.url),
            status_code=self.status,
            stream=bool(request.get("stream")),
            started_at=self.started_at,
            latency_s=latency,
            logprobs_mode=self.logprobs_mode,
            error=message,
            source=source,
            **_served(seen.get(VERSION_HEADER), seen.get(SERVED_HEADER)),
            **fields,
        )
        _insert(self.trajectory.llm_calls, call)

    def _parse(
        self, error: str | None, early: bool, streamed: bool, seen: dict[str, str]
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The completion body (a stream reassembled) and the error, if any. A stream is recognised by the
        request's `stream` (as the openai SDK decides), or by the answer's content type."""
        raw = b"".join(self.chunks)
        if not self.decoded:
            raw = _decoded(raw, seen.get("content-encoding", "identity"))
        status = self.status or 0
        if status >= 400:
            text = raw.decode("utf-8", errors="replace")
            return None, error or f"HTTP {status}: {text[:2000]}"
        if streamed or "text/event-stream" in seen.get("content-type", ""):
            events, done, stream_error = parse_events(raw)
            if self.kind in _FINAL_EVENT:  # no [DONE]: a final event ends the stream
                final, last = _FINAL_EVENT[self.kind]
                response, done = final(events)
                if error is None and not done:
                    ended = "closed" if early else "ended"
                    error = stream_error or f"stream {ended} before its final {last} event"
                return response, error or stream_error
            if error is None and not done:
                error = stream_error or (
                    "stream closed before [DONE]" if early else "stream ended before [DONE]"
                )
            return reassemble(events), error or stream_error
        try:
            body = _loads(raw)
        except ValueError:
            if early:
                return None, error or "response closed before its body was read"
            return None, error or f"invalid JSON response: {raw[:200]!r}"
        if not isinstance(body, dict):
            return None, error or f"unexpected JSON response: {raw[:200]!r}"
        return body, error


def served_version(headers: httpx.Headers | None) -> dict[str, Any]:
    """The policy version and adapter our gateway names in an answer's headers (nothing from other servers)."""
    if headers is None:
        return {}
    return _served(headers.get(VERSION_HEADER), headers.get(SERVED_HEADER))


def _served(version: str | None, served: str | None) -> dict[str, Any]:
    step = parse_step(version or "")
    if step is None:
        return {}
    return {"policy_version": step, "served_model": served}


_READ_HEADERS = ("content-type", "content-encoding", VERSION_HEADER, SERVED_HEADER)


def _header_values(headers: Any) -> dict[str, str]:
    """The answer's headers capture reads (content type and encoding, our gateway's version), in one pass (each
    `Headers.get` scans every header); a repeated one comma-joined, as `Headers.get` returns it."""
    out: dict[str, str] = {}
    if headers is None:
        return out
    for key, value in headers.raw:
        name = key.decode("latin-1").lower()
        if name in _READ_HEADERS:
            text = value.decode("latin-1")
            out[name] = f"{out[name]}, {text}" if name in out else text
    return out


def body_fields(body: dict[str, Any], streamed: bool = False) -> dict[str, Any]:
    """LLMCall fields of a (reassembled) completion body: the body itself and its vLLM token ids / logprobs."""
    choices = body.get("choices") or []
    prompt_ids = body.get("prompt_token_ids")
    if prompt_ids is None and choices:
        prompt_ids = choices[0].get("prompt_token_ids")
    fields: dict[str, Any] = {"response": body, "prompt_token_ids": prompt_ids}
    others: list[SampledChoice] = []
    for choice in choices:
        index = choice.get("index", 0)
        ids = choice.get("token_ids")
        logprobs = _logprobs(choice.get("logprobs"))
        if index == 0 and "completion_token_ids" not in fields:
            fields["completion_token_ids"] = ids
            fields["logprobs"] = logprobs
        else:
            others.append(
                SampledChoice(
                    index=index, token_ids=ids, logprobs=logprobs, finish_reason=choice.get("finish_reason")
                )
            )
    fields["other_choices"] = others
    return fields


def responses_fields(body: dict[str, Any], streamed: bool = False) -> dict[str, Any]:
    """LLMCall fields of a Responses API body: the body and vLLM's token ids / output logprobs."""
    return {"response": body, **token_fields(body, streamed=streamed)}


def messages_fields(body: dict[str, Any], streamed: bool = False) -> dict[str, Any]:
    """LLMCall fields of an Anthropic Messages body: the body only (no token ids on this API)."""
    return {"response": body}


# APIs whose streams end with a final event instead of [DONE]: what rebuilds the answer, and that event's name
_FINAL_EVENT = {"responses": (final_response, "response"), "messages": (final_message, "message_stop")}
_FIELDS = {
    "chat": body_fields,
    "completions": body_fields,
    "responses": responses_fields,
    "messages": messages_fields,
}


def _logprobs(value: Any) -> list[float] | None:
    if not isinstance(value, dict):
        return None
    content = value.get("content")
    if isinstance(content, list):
        return [entry["logprob"] for entry in content]
    token_logprobs = value.get("token_logprobs")  # legacy /completions shape
    return list(token_logprobs) if isinstance(token_logprobs, list) else None


def decode(raw: bytes, headers: httpx.Headers) -> bytes:
    """Undo a content-encoding (gzip, br, ...) with httpx's own decoders; identity is free."""
    return _decoded(raw, headers.get("content-encoding", "identity"))


def _decoded(raw: bytes, content_encoding: str) -> bytes:
    encoding = content_encoding.strip().lower()
    if not raw or encoding in ("", "identity"):
        return raw
    try:
        return httpx.Response(200, headers={"content-encoding": encoding}, content=raw).read()
    except httpx.DecodingError:
        return raw


def _describe(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    return f"{type(error).__name__}: {error}"


def _insert(calls: list[LLMCall], call: LLMCall) -> None:
    """Append, keeping the list ordered by start time (calls of one rollout can finish out of order)."""
    if not calls or calls[-1].started_at <= call.started_at:
        calls.append(call)
        return
    position = len(calls)
    while position > 0 and calls[position - 1].started_at > call.started_at:
        position -= 1
    calls.insert(position, call)
