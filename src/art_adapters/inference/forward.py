"""Forwarding one HTTP request upstream and streaming the answer back, bytes untouched, for as long as the client
listens: a client that goes away (before the answer's headers, or mid-stream) cancels the upstream request, so the
engine stops generating for nobody."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..untrusted import forwarded_headers

# Headers that describe one hop (RFC 9110 §7.6.1) or that the forwarder sets itself.
HOP_HEADERS = frozenset(
    {
        "authorization",
        "connection",
        "content-length",
        "host",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_ERROR_BODY_LIMIT = 64 * 1024
_GONE_POLL_S = 0.1  # how often `gone()` is asked again after a dropped connection
_ENGINE_DEAD = re.compile(
    rb"EngineCore encountered an issue|EngineDeadError|engine (?:is )?dead", re.IGNORECASE
)
# vLLM's unknown-model answer lists every name the engine serves ("Valid aliases: ...").
_MODEL_NOT_FOUND = re.compile(r"model .* does not exist", re.IGNORECASE)


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def engine_dead(status: int, body: bytes) -> bool:
    """Whether vLLM's error answer says its engine died (the request reached no engine: safe to send again)."""
    return status >= 500 and bool(_ENGINE_DEAD.search(body))


def end_to_end_headers(headers: httpx.Headers | Any) -> dict[str, str]:
    """A client's request headers that go on to the engine: the APIs' own (`untrusted.FORWARDED_REQUEST_HEADERS`),
    printable ASCII only. Never `X-Request-Id`, `X-data-parallel-rank`, cookies or a hop's headers."""
    return forwarded_headers(headers.items())


def response_headers(headers: httpx.Headers) -> dict[str, str]:
    """An upstream answer's headers that go back to the client: all but those describing one hop."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


class Forwarded(Response):
    """The answer to `upstream` (an httpx request), sent as it arrives. `on_done()` runs once, however it ends
    (completed, failed, client gone); `headers` are added to the answer's. An upstream error answer is passed on
    with its status, but an engine's list of the names it serves is never shown (`requested` names the model).
    `recover()`: where the upstream was not there to serve it (unreachable, or an error answer `dead(status, body)`
    says came from a dead engine: nothing was generated, so sending it again is safe), the request to send instead
    once it is back (None: give up). `gone()`: whether the engine that was sent the request has died, so a connection
    it dropped before answering (a kept-alive one to a killed process) is sent again too; asked again for up to
    `gone_within_s` (a dying engine's server drops its connections before its process is seen to have exited);
    None: it cannot be seen to die (another host's engine), so it is not asked again."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        upstream: httpx.Request,
        *,
        requested: str | None = None,
        headers: dict[str, str] | None = None,
        on_done: Callable[[], None] | None = None,
        recover: Callable[[], Awaitable[httpx.Request | None]] | None = None,
        dead: Callable[[int, bytes], bool] | None = None,
        gone: Callable[[], bool | None] | None = None,
        gone_within_s: float = 0.0,
        retries: int = 1,
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.requested = requested
        self.extra_headers = headers or {}
        self.on_done = on_done
        self.recover = recover
        self.dead = dead
        self.gone = gone
        self.gone_within_s = gone_within_s
        self.retries = retries if recover is not None else 0  # how many times `recover()` may be asked
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()  # the client left: stop waiting, close the upstream request

                group.start_soon(watch)
                await self._relay(send)
                group.cancel_scope.cancel()
        except OSError:  # the client left while we wrote to it (ASGI 2.4 servers raise instead of telling)
            pass
        finally:
            if self.on_done is not None:
                self.on_done()

    async def _relay(self, send: Send) -> None:
        response = await self._open(send)
        if response is None:
            return
        try:
            headers = response_headers(response.headers)
            if "content-length" in response.headers:  # raw bytes pass through, so the upstream length holds
                headers["content-length"] = response.headers["content-length"]
            headers.update(self.extra_headers)
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            await send({"type": "http.response.start", "status": response.status_code, "headers": raw})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _open(self, send: Send) -> httpx.Response | None:
        """The upstream's successful answer, its headers read; or None once an error answer was sent."""
        for _ in range(self.retries + 1):
            try:
                response = await self.client.send(self.upstream, stream=True)
            except httpx.HTTPError as error:
                again = None
                unsent = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))  # nothing was sent
                dropped = isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
                if self.retries > 0 and (unsent or (dropped and await self._engine_gone())):
                    # nothing was sent, or its engine died before answering: safe to send again
                    self.retries -= 1
                    again = await self.recover()  # type: ignore[misc]
                if again is None:
                    await _send_error(send, 502, f"inference server unreachable: {type(error).__name__}")
                    return None
                self.upstream = again
                continue
            if response.status_code < 400:
                return response
            body = await _bounded_body(response)
            await response.aclose()
            if self.retries > 0 and self.dead is not None and self.dead(response.status_code, body):
                self.retries -= 1
                again = await self.recover()  # type: ignore[misc]
                if again is not None:
                    self.upstream = again
                    continue
            await _send_whole(send, response, self._scrubbed(response.status_code, body), self.extra_headers)
            return None
        raise AssertionError("unreachable: the last try answers")  # pragma: no cover

    async def _engine_gone(self) -> bool:
        """Whether `gone()` says so now or within `gone_within_s` (bounded: a live engine's drop is not retried)."""
        if self.gone is None:
            return False
        deadline = anyio.current_time() + self.gone_within_s
        while not (dead := self.gone()):
            if dead is None or anyio.current_time() >= deadline:
                return False
            await anyio.sleep(min(_GONE_POLL_S, self.gone_within_s))
        return True

    def _scrubbed(self, status: int, body: bytes) -> bytes:
        """An error body, unless it is the engine's unknown-model answer (which lists every served name)."""
        if status == 404 and _MODEL_NOT_FOUND.search(body.decode("utf-8", errors="replace")):
            message = f"model {self.requested!r} is not served here"
            return json.dumps({"error": {"message": message, "type": "not_found", "code": 404}}).encode()
        return body


async def _bounded_body(response: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > _ERROR_BODY_LIMIT:
            break
    return b"".join(chunks)[:_ERROR_BODY_LIMIT]


async def _send_whole(send: Send, response: httpx.Response, body: bytes, extra: dict[str, str]) -> None:
    headers = {k: v for k, v in response_headers(response.headers).items() if k.lower() != "content-encoding"}
    headers.update(extra)
    headers["content-length"] = str(len(body))
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "upstream_error", "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
