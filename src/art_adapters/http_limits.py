"""What every HTTP server we run (serve, the inference gateway, the recording endpoint) enforces below its app: a cap
on open connections, a bound on a request's head, and deadlines for the head and the body (each read, and a least
average rate), so a client that stops or trickles (Slowloris) is closed instead of holding a connection, and file
descriptors, forever.

uvicorn has neither (its keep-alive timer starts only after a response); `uvicorn_config` gives it both through a
protocol class derived from the one uvicorn would pick (httptools, else h11). uvicorn is imported only when used.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)
_RESERVED_FDS = 256  # kept for checkpoints, logs, the engine's pipes
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class ConnectionLimits(BaseModel):
    """How many connections a server holds and how long it waits for a client that is sending a request."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(
        1024,
        gt=0,
        description=(
            "Open connections at once; one more is answered 503 and closed. Never more than the process's "
            "file-descriptor limit allows (two per proxied connection, 256 kept for files)."
        ),
    )
    header_timeout_s: float = Field(
        15.0, gt=0, description="A request's line and headers arrive within this (a new connection's too)."
    )
    body_timeout_s: float = Field(60.0, gt=0, description="The longest wait for more of a request's body.")
    min_body_bytes_per_s: float = Field(
        1024.0,
        ge=0,
        description=(
            "Once a body has been arriving for `body_timeout_s`, its average rate must stay at least this, or the "
            "connection is closed (a client trickling a byte per deadline holds nothing for long)."
        ),
    )
    max_head_bytes: int = Field(
        65536, gt=0, description="A request's line and headers together; more is answered 431 and closed."
    )

    def connection_cap(self) -> int:
        """`max_connections`, lowered to what the open-file limit leaves room for."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        room = max(16, (soft - _RESERVED_FDS) // 2)
        if room < self.max_connections:
            log.warning(
                "at most %d connections (not %d): the open-file limit is %d", room, self.max_connections, soft
            )
        return min(self.max_connections, room)


def uvicorn_config(
    app: Any, *, host: str, port: int, limits: ConnectionLimits | None, **settings: Any
) -> Any:
    """A `uvicorn.Config` serving `app` under `limits` (default: `ConnectionLimits()`); `settings` as uvicorn's."""
    import uvicorn

    protocol = protocol_class(limits or ConnectionLimits())
    return uvicorn.Config(CloseEarlyAnswers(app), host=host, port=port, http=protocol, **settings)


class CloseEarlyAnswers:
    """ASGI middleware: an answer sent before the request's body was read (a 401, 404 or 413 that never looked at
    it) says `connection: close`, so no client sends its next request on a connection whose rest of a body is
    still arriving; the server reads that rest and then closes (a lingering close, below)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        unread = [headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers]

        async def receiving() -> Any:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread[0] = False
            return message

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start" and unread[0]:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receiving, sending)


class _Lingering:
    """The connection's transport, whose `close()` while a request's body is still arriving reads the rest first
    (the client then reads the whole answer, instead of a reset that discards it)."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        self.real = transport
        self.protocol = protocol

    def close(self) -> None:
        if self.protocol._reading == "body" and not self.real.is_closing():
            self.protocol._linger()
        else:
            self.real.close()

    def is_closing(self) -> bool:
        return self.real.is_closing() or self.protocol._reading == "linger"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol with the cap and the deadlines of `limits`."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base  # noqa: N814
    except ImportError:  # no httptools: uvicorn's h11 protocol
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # noqa: N814
    cap = limits.connection_cap()
    h11_based = Base.__name__ == "H11Protocol"

    class Bounded(Base):  # type: ignore[misc, valid-type]
        """States: `head` (waiting for the line and headers), `body` (reading it), `app` (the app has the request:
        no deadline), `idle` (between requests: uvicorn's keep-alive timer runs), `linger` (closed while the body
        was still arriving: the rest is read and dropped, then the connection ends)."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            self._reading = "head"
            self._head_bytes = 0
            self._body_bytes = 0
            self._body_since = 0.0
            self._real = transport
            super().connection_made(_Lingering(transport, self))  # type: ignore[arg-type]
            if len(self.connections) > cap:
                transport.write(_BUSY)
                transport.close()
                return
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._reading == "idle":  # the first bytes of the next request
                self._reading = "head"
                self._head_bytes = 0
                self._arm(limits.header_timeout_s)
            if self._reading == "body":  # progress: the body's deadline starts again, if it keeps a rate
                self._body_bytes += len(data)
                if self._trickling():
                    self._real.close()  # the app sees the client disconnect
                    return
                self._arm(limits.body_timeout_s)
            elif self._reading == "head":
                self._head_bytes += len(data)
            super().data_received(data)
            if h11_based:
                self._follow_h11()
            if self._reading == "head" and self._head_bytes > limits.max_head_bytes:
                self._real.write(_HEAD_TOO_LARGE)
                self._real.close()

        def _trickling(self) -> bool:
            elapsed = self.loop.time() - self._body_since
            return (
                elapsed > limits.body_timeout_s and self._body_bytes < limits.min_body_bytes_per_s * elapsed
            )

        # httptools' parser callbacks
        def on_headers_complete(self) -> None:
            self._enter("body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            lingering = self._reading == "linger"
            self._enter("app")
            super().on_message_complete()
            if lingering:
                self._real.close()

        def on_response_complete(self) -> None:
            if self._reading != "linger":
                self._enter("idle")
            super().on_response_complete()
            if h11_based:
                self._follow_h11()

        def _follow_h11(self) -> None:
            import h11

            state = self.conn.their_state
            if self._reading == "linger":
                if state is not h11.SEND_BODY:
                    self._real.close()
            elif state is h11.SEND_BODY:
                self._enter("body")
            elif state is not h11.IDLE:
                self._enter("app")

        def _linger(self) -> None:
            """Closed mid-body: send the end of our side after the answer, read the rest, close within a bound."""
            self._reading = "linger"
            self._real.resume_reading()
            if self._real.can_write_eof():
                self._real.write_eof()
            self._arm(limits.header_timeout_s)

        def _enter(self, reading: str) -> None:
            if reading == self._reading:
                return
            self._reading = reading
            if reading == "body":
                self._body_bytes, self._body_since = 0, self.loop.time()
                self._arm(limits.body_timeout_s)
            else:
                self._disarm()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, seconds: float) -> None:
            self._deadline = None
            if self._real.is_closing():
                return
            if self._reading == "body" and self.flow.read_paused:  # the app has not read what arrived yet
                self._arm(seconds)
                return
            if self._reading == "head":
                self._real.write(_TOO_SLOW)
            self._real.close()  # mid-body: the app sees the client disconnect

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{Base.__name__}"
    return Bounded
