"""A connection the engine drops before answering (a kept-alive one to a killed process): sent again once the
engine is back only when its engine has died; a live engine's dropped request is not sent twice (it may have run)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from art_adapters.inference.forward import Forwarded

pytestmark = pytest.mark.asyncio


async def dropping_server() -> tuple[asyncio.Server, str]:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request arrived; the process "dies" before answering
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def answer(forwarded: Forwarded) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await forwarded({"type": "http"}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


class Engines(httpx.AsyncBaseTransport):
    """The dropping server through a real transport (`dropped_at`: when each exchange with it ended), and the
    restarted engine at host `engine-back`, which answers 200."""

    def __init__(self) -> None:
        self.real = httpx.AsyncHTTPTransport()
        self.dropped_at: list[float] = []
        self.recovered: list[bool] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "engine-back":
            return httpx.Response(200, stream=httpx.ByteStream(b'{"ok": true}'))
        try:
            return await self.real.handle_async_request(request)
        finally:
            self.dropped_at.append(asyncio.get_running_loop().time())

    async def recover(self) -> httpx.Request:
        """The request sent again, to the restarted engine (counted in `recovered`)."""
        self.recovered.append(True)
        return httpx.Request("POST", "http://engine-back/v1/chat/completions", json={})


def forwarded(client: httpx.AsyncClient, url: str, **kwargs: Any) -> Forwarded:
    return Forwarded(client, client.build_request("POST", f"{url}/v1/chat/completions", json={}), **kwargs)


@pytest.mark.parametrize("engine_died", [True, False])
async def test_a_dropped_connection_is_sent_again_only_when_its_engine_died(engine_died: bool) -> None:
    server, url = await dropping_server()
    engines = Engines()
    async with server, httpx.AsyncClient(transport=engines) as client:
        status, body = await answer(
            forwarded(
                client,
                url,
                recover=engines.recover,
                gone=lambda: engine_died,
                gone_within_s=0.3,  # a live engine is asked again a while, then its dropped request fails
            )
        )
    if engine_died:
        assert (status, engines.recovered) == (200, [True]), body
    else:
        assert status == 502 and engines.recovered == [], body
        assert b"ReadError" in body or b"RemoteProtocolError" in body


async def test_a_dropped_connection_is_sent_again_when_its_engine_is_seen_dead_only_a_moment_later() -> None:
    """A dying engine's server drops its connections before its process has exited (its engine core died first;
    a killed process's sockets close before it can be reaped): `gone()` turns true a moment after the drop."""
    server, url = await dropping_server()
    engines = Engines()

    def gone() -> bool:  # the process is reaped 0.3 s after its connection dropped
        dropped_at = engines.dropped_at
        return bool(dropped_at) and asyncio.get_running_loop().time() - dropped_at[0] > 0.3

    async with server, httpx.AsyncClient(transport=engines) as client:
        status, body = await answer(
            forwarded(client, url, recover=engines.recover, gone=gone, gone_within_s=5.0)
        )
    assert (status, engines.recovered) == (200, [True]), body


async def test_an_engine_that_cannot_be_seen_to_die_is_asked_once() -> None:
    """`gone()` answering None (another host's engine): its dropped request fails at once, not after the wait."""
    server, url = await dropping_server()
    asked: list[bool] = []

    async def recover() -> httpx.Request:
        raise AssertionError("a request another host's engine dropped is not sent again")

    def gone() -> None:
        asked.append(True)

    async with server, httpx.AsyncClient() as client:
        status, body = await answer(forwarded(client, url, recover=recover, gone=gone, gone_within_s=60.0))
    assert (status, asked) == (502, [True]), body
