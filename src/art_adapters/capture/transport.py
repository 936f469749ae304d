"""httpx transports that record OpenAI-compatible exchanges into the current capture scope, bytes untouched.

They work with `httpx` and with `httpx2` (the fork openai >= 3 is built on): objects are rebuilt with the types the
inner transport returned, and the stream wrappers subclass both libraries' stream bases.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from ..agent_adapters import AgentRouting
from ..apis.responses import ask_token_ids as ask_responses_token_ids
from ..calls import ROLLOUT_HEADER, endpoint_kind, policy_token_spans
from .frameworks import source_of_context
from .overrides import OVERRIDE, overridden
from .record import Exchange, decode, served_version
from .sampling import sampling_note
from .scope import CURRENT, rollout_key

try:
    import httpx2
except ImportError:  # pragma: no cover - openai < 3
    httpx2 = None

_SYNC_STREAMS: tuple[type, ...] = (httpx.SyncByteStream,) + ((httpx2.SyncByteStream,) if httpx2 else ())
_ASYNC_STREAMS: tuple[type, ...] = (httpx.AsyncByteStream,) + ((httpx2.AsyncByteStream,) if httpx2 else ())
_SYNC_TRANSPORTS: tuple[type, ...] = (httpx.BaseTransport,) + ((httpx2.BaseTransport,) if httpx2 else ())
_ASYNC_TRANSPORTS: tuple[type, ...] = (httpx.AsyncBaseTransport,) + (
    (httpx2.AsyncBaseTransport,) if httpx2 else ()
)

_DROP_ON_REWRITE = {"content-encoding", "content-length", "transfer-encoding"}


def _kind(request: httpx.Request) -> str | None:
    return endpoint_kind(request.url.path) if request.method == "POST" else None


def _ask_token_ids(
    request: httpx.Request, body: bytes, kind: str = "chat"
) -> tuple[httpx.Request, bytes, dict[str, Any] | None]:
    """Add vLLM's `return_token_ids` and `logprobs` where the body does not set them (for the Responses API,
    `enable_response_messages` and the output text's logprobs)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return request, body, None
    if not isinstance(payload, dict):
        return request, body, None
    if kind == "responses":
        asked = ask_responses_token_ids(payload)
        if asked == payload:
            return request, body, payload
        payload = asked
    elif "return_token_ids" in payload and "logprobs" in payload:
        return request, body, payload
    else:
        payload.setdefault("return_token_ids", True)
        payload.setdefault("logprobs", True)
    body = json.dumps(payload).encode()
    return _rebuilt(request, body), body, payload


def _rebuilt(request: httpx.Request, body: bytes) -> httpx.Request:
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _DROP_ON_REWRITE]
    headers.append(("content-length", str(len(body))))
    return type(request)(
        request.method, request.url, headers=headers, content=body, extensions=request.extensions
    )


def _routed(
    request: httpx.Request, body: bytes, payload: dict[str, Any] | None, routing: AgentRouting
) -> tuple[httpx.Request, bytes, dict[str, Any] | None]:
    """Per-agent adapters: the request's `model` rewritten to its agent's served adapter (from the call's source,
    read in the task that sends it), when the routing says so; otherwise the request as it was."""
    if payload is None:
        payload = _json_or_none(body)
        if payload is None:
            return request, body, None
    routed = routing.rewrite(payload.get("model"), source_of_context())
    if routed is None:
        return request, body, payload
    payload = {**payload, "model": routed}
    body = json.dumps(payload).encode()
    return _rebuilt(request, body), body, payload


def _annotated(
    response: httpx.Response, raw: bytes, exchange: Exchange | None, request: dict[str, Any] | None
) -> httpx.Response:
    """Copy the top-level `prompt_token_ids` into each choice, with the sampling it came from (temperature and the
    settings the trainer cannot reproduce), so a kept openai Choice trains against the right distribution."""
    decoded = decode(raw, response.headers)
    try:
        body = json.loads(decoded)
    except ValueError:
        body = None
    if exchange is not None:
        exchange.status, exchange.headers = response.status_code, response.headers
        exchange.chunks.append(raw)
        if isinstance(body, dict):
            exchange.finish(body=body)
        else:
            exchange.finish()
    ids = body.get("prompt_token_ids") if isinstance(body, dict) else None
    if ids is None or not isinstance(body.get("choices"), list):  # type: ignore[union-attr]
        # already read (and decoded once, as the client would): the caller sees the same bytes and headers
        return type(response)(
            response.status_code, headers=response.headers, content=raw, extensions=response.extensions
        )
    note = sampling_note(request or {})
    served = served_version(response.headers)
    choices = [
        {**c, "prompt_token_ids": ids, "sampling": note, **_versioned(c, served)}
        if isinstance(c, dict)
        else c
        for c in body["choices"]  # type: ignore[index]
    ]
    content = json.dumps({**body, "choices": choices}).encode()  # type: ignore[dict-item]
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _DROP_ON_REWRITE]
    return type(response)(
        response.status_code, headers=headers, content=content, extensions=response.extensions
    )


def _versioned(choice: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """ART's per-choice record of the policy that sampled it (`policy_token_spans`), where our gateway said."""
    if not served:
        return {}
    spans = policy_token_spans(
        served["policy_version"], served["served_model"], len(choice.get("token_ids") or [])
    )
    return {
        "policy_version": served["policy_version"],
        "policy_token_spans": spans,
        "served_model": served["served_model"],  # whose version it is, also when no token was sampled
    }


def _json_or_none(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _wants_annotation(response: httpx.Response, payload: dict[str, Any] | None) -> bool:
    """A JSON answer to a non-streamed request (a stream is never buffered, whatever its content type)."""
    if response.status_code >= 300 or "text/event-stream" in response.headers.get("content-type", ""):
        return False
    return not (payload or {}).get("stream")


class _Options:
    __slots__ = ("request_token_ids", "annotate_choices", "logprobs_mode", "routing", "rewrites")

    def __init__(
        self,
        request_token_ids: bool,
        annotate_choices: bool,
        logprobs_mode: str | None,
        routing: AgentRouting | None = None,
    ) -> None:
        self.request_token_ids = request_token_ids
        self.annotate_choices = annotate_choices
        self.logprobs_mode = logprobs_mode
        self.routing = routing
        self.rewrites = request_token_ids or annotate_choices or routing is not None


class RecordingTransport(*_SYNC_TRANSPORTS):  # type: ignore[misc]
    """Wraps a transport; records `/chat/completions`, `/responses`, `/completions` and Anthropic `/v1/messages`
    POSTs made inside `capture()`.

    `request_token_ids`: ask vLLM for token ids and logprobs. `annotate_choices`: copy `prompt_token_ids` into each
    choice of JSON answers (our backend only; the one case where a body is rewritten). `routing`: per-agent
    adapters (`art.PerAgent`): the request's model name becomes its agent's adapter. Outside a scope and with all
    three off, requests pass straight through.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | Any | None = None,
        *,
        request_token_ids: bool = False,
        annotate_choices: bool = False,
        logprobs_mode: str | None = None,
        routing: AgentRouting | None = None,
    ) -> None:
        self.inner = transport if transport is not None else httpx.HTTPTransport()
        self.options = _Options(request_token_ids, annotate_choices, logprobs_mode, routing)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        trajectory = CURRENT.get()
        options = self.options
        override = OVERRIDE.get()  # an evaluation's sampling and target, for this context only
        if trajectory is None and not options.rewrites and override is None:
            return self.inner.handle_request(request)
        kind = _kind(request)
        if kind is None:
            return self.inner.handle_request(request)
        body = request.read()
        if override is not None:
            request, body = overridden(request, body, kind, override)
        payload = None
        if options.routing is not None:
            request, body, payload = _routed(request, body, payload, options.routing)
        if options.request_token_ids and kind in ("chat", "responses"):
            request, body, payload = _ask_token_ids(request, body, kind)
        elif options.annotate_choices and kind == "chat":  # parsed once: the annotation reads the request
            payload = _json_or_none(body)
        if (
            options.request_token_ids and trajectory is not None
        ):  # our backend: the rollout stays on one engine
            request.headers[ROLLOUT_HEADER] = rollout_key(trajectory)
        exchange = (
            Exchange(trajectory, request, body, payload, options.logprobs_mode, kind)
            if trajectory is not None
            else None
        )
        try:
            response = self.inner.handle_request(request)
        except BaseException as error:  # cancellation too: the record still ends
            if exchange is not None:
                exchange.finish(error)
            raise
        if options.annotate_choices and kind == "chat" and _wants_annotation(response, payload):
            try:
                raw = b"".join(response.stream)
            except Exception as error:
                response.close()
                if exchange is not None:
                    exchange.status, exchange.headers = response.status_code, response.headers
                    exchange.finish(error)
                raise
            response.close()
            return _annotated(response, raw, exchange, payload)
        if exchange is None:
            return response
        exchange.status, exchange.headers = response.status_code, response.headers
        if response.is_closed:  # already read (e.g. a MockTransport's Response(content=...)): decoded bytes
            exchange.decoded = True
            exchange.chunks.append(response.content)
            exchange.finish()
            return response
        response.stream = _SyncTee(response.stream, exchange)
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncRecordingTransport(*_ASYNC_TRANSPORTS):  # type: ignore[misc]
    """The async twin of RecordingTransport (same options, same records)."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | Any | None = None,
        *,
        request_token_ids: bool = False,
        annotate_choices: bool = False,
        logprobs_mode: str | None = None,
        routing: AgentRouting | None = None,
    ) -> None:
        self.inner = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.options = _Options(request_token_ids, annotate_choices, logprobs_mode, routing)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        trajectory = CURRENT.get()
        options = self.options
        override = OVERRIDE.get()  # an evaluation's sampling and target, for this context only
        if trajectory is None and not options.rewrites and override is None:
            return await self.inner.handle_async_request(request)
        kind = _kind(request)
        if kind is None:
            return await self.inner.handle_async_request(request)
        body = await request.aread()
        if override is not None:
            request, body = overridden(request, body, kind, override)
        payload = None
        if options.routing is not None:
            request, body, payload = _routed(request, body, payload, options.routing)
        if options.request_token_ids and kind in ("chat", "responses"):
            request, body, payload = _ask_token_ids(request, body, kind)
        elif options.annotate_choices and kind == "chat":  # parsed once: the annotation reads the request
            payload = _json_or_none(body)
        if (
            options.request_token_ids and trajectory is not None
        ):  # our backend: the rollout stays on one engine
            request.headers[ROLLOUT_HEADER] = rollout_key(trajectory)
        exchange = (
            Exchange(trajectory, request, body, payload, options.logprobs_mode, kind)
            if trajectory is not None
            else None
        )
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as error:  # cancellation too: the record still ends
            if exchange is not None:
                exchange.finish(error)
            raise
        if options.annotate_choices and kind == "chat" and _wants_annotation(response, payload):
            try:
                raw = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
            except Exception as error:
                await response.aclose()
                if exchange is not None:
                    exchange.status, exchange.headers = response.status_code, response.headers
                    exchange.finish(error)
                raise
            await response.aclose()
            return _annotated(response, raw, exchange, payload)
        if exchange is None:
            return response
        exchange.status, exchange.headers = response.status_code, response.headers
        if response.is_closed:  # already read (e.g. a MockTransport's Response(content=...)): decoded bytes
            exchange.decoded = True
            exchange.chunks.append(response.content)
            exchange.finish()
            return response
        response.stream = _AsyncTee(response.stream, exchange)  # type: ignore[arg-type]
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _SyncTee(*_SYNC_STREAMS):  # type: ignore[misc]
    """Passes the body through chunk by chunk, keeping a reference to each; records when it ends or closes."""

    __slots__ = ("_inner", "_exchange")

    def __init__(self, inner: Any, exchange: Exchange) -> None:
        self._inner = inner
        self._exchange = exchange

    def __iter__(self) -> Iterator[bytes]:
        append = self._exchange.chunks.append
        try:
            for chunk in self._inner:
                append(chunk)
                yield chunk
        except BaseException as error:  # cancellation too: the record still ends
            self._exchange.finish(error)
            raise
        self._exchange.finish()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._exchange.finish(early=True)


class _AsyncTee(*_ASYNC_STREAMS):  # type: ignore[misc]
    __slots__ = ("_inner", "_exchange")

    def __init__(self, inner: Any, exchange: Exchange) -> None:
        self._inner = inner
        self._exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        append = self._exchange.chunks.append
        try:
            async for chunk in self._inner:
                append(chunk)
                yield chunk
        except BaseException as error:  # cancellation too: the record still ends
            self._exchange.finish(error)
            raise
        self._exchange.finish()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._exchange.finish(early=True)
