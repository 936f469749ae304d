"""Lets httpx2 clients (openai 3.x's HTTP library) record through capture's httpx transports, bytes untouched.

The recording transport only reads requests and responses through the API both libraries share, so httpx2 objects
pass through it unconverted; only what it builds itself (an httpx request asking for token ids, an annotated
httpx response) and its recording body stream are converted or re-typed at the edges.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import httpx2

from ..capture import AsyncRecordingTransport, RecordingTransport


class _AsyncStream(httpx.AsyncByteStream, httpx2.AsyncByteStream):
    """An async byte stream both libraries accept, passing the chunks of another through."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _SyncStream(httpx.SyncByteStream, httpx2.SyncByteStream):
    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        yield from self._inner

    def close(self) -> None:
        self._inner.close()


def _to_httpx2_request(request: Any, content: bytes) -> httpx2.Request:
    return httpx2.Request(
        request.method,
        str(request.url),
        headers=request.headers.raw,
        content=content,
        extensions=request.extensions,
    )


def _to_httpx2_response(response: Any, stream_type: type) -> httpx2.Response:
    """The recorder's answer as an httpx2 response whose body stream httpx2 accepts."""
    if isinstance(response, httpx2.Response):
        if not isinstance(response.stream, httpx2.AsyncByteStream | httpx2.SyncByteStream):
            response.stream = stream_type(response.stream)
        return response
    return httpx2.Response(
        response.status_code,
        headers=response.headers.raw,
        stream=stream_type(response.stream),
        extensions=response.extensions,
    )


class _SendAsync(httpx.AsyncBaseTransport):
    """What the recorder wraps: the client's own httpx2 transport (an httpx request it built is converted)."""

    def __init__(self, transport: httpx2.AsyncBaseTransport) -> None:
        self.transport = transport

    async def handle_async_request(self, request: Any) -> Any:
        if not isinstance(request, httpx2.Request):
            request = _to_httpx2_request(request, await request.aread())
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:  # the client owns and closes its own transport
        pass


class _SendSync(httpx.BaseTransport):
    def __init__(self, transport: httpx2.BaseTransport) -> None:
        self.transport = transport

    def handle_request(self, request: Any) -> Any:
        if not isinstance(request, httpx2.Request):
            request = _to_httpx2_request(request, request.read())
        return self.transport.handle_request(request)

    def close(self) -> None:
        pass


class AsyncBridge(httpx2.AsyncBaseTransport):
    """An httpx2 transport recording through capture's AsyncRecordingTransport."""

    def __init__(self, recording: AsyncRecordingTransport) -> None:
        self.recording = recording

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.recording.handle_async_request(request)  # type: ignore[arg-type]
        return _to_httpx2_response(response, _AsyncStream)

    async def aclose(self) -> None:
        pass


class SyncBridge(httpx2.BaseTransport):
    def __init__(self, recording: RecordingTransport) -> None:
        self.recording = recording

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.recording.handle_request(request)  # type: ignore[arg-type]
        return _to_httpx2_response(response, _SyncStream)

    def close(self) -> None:
        pass


def wrap_async(transport: httpx2.AsyncBaseTransport, **options: Any) -> AsyncBridge:
    """Record, then send with the client's own `transport`."""
    return AsyncBridge(AsyncRecordingTransport(_SendAsync(transport), **options))


def wrap_sync(transport: httpx2.BaseTransport, **options: Any) -> SyncBridge:
    return SyncBridge(RecordingTransport(_SendSync(transport), **options))
