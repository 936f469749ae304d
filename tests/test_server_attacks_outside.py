"""What an outside attacker found in our servers, each kept fixed: bodies are refused at their declared length or as
they stream past the inference limit (serve read 256 MiB, the gateway without bound, before any check); record mode
answers a deeply nested body 400 (it raised a RecursionError: 500) and matches conversations in one pass (it hashed
every prefix: 8,000 messages froze the server for 13 s); a reward body nested too deeply is a 400; the gateway's
404 for a version that failed to load names no path; the recording endpoint cancels the upstream when its agent
hangs up, and its 502 shows no credentials of the upstream URL."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.capture.live import MAX_CHAINED_MESSAGES, LiveRecorder
from art_adapters.http_limits import uvicorn_config
from art_adapters.inference.gateway import Gateway
from art_adapters.store import open_store
from art_adapters.testing import ScriptedServer
from test_gateway_versions import SlowEngine
from test_remote_backend import FakeBackend, free_port, running

ADMIN, INFERENCE = "admin-key-1", "inference-key-2"
MIB = 1 << 20


@contextmanager
def serving(tmp: Path, upstream: str, **settings: Any) -> Iterator[str]:
    """serve's app as launch.py runs it (connection limits, httptools) over a FakeBackend."""
    app = create_app(
        FakeBackend(str(tmp / "art"), upstream), api_key=ADMIN, inference_key=INFERENCE, **settings
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn_config(app, host="127.0.0.1", port=port, limits=None, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "serve did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def first_answer(port: int, key: str, declared: int, send_mib: int) -> bytes:
    """Declare a body of `declared` bytes, send `send_mib` MiB of it, and read what the server says."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {declared}\r\n\r\n".encode()
        )
        sock.settimeout(15)
        try:
            for _ in range(send_mib):
                sock.sendall(b" " * MIB)
        except OSError:
            pass  # refused and closed while we were still sending: what we want
        return sock.recv(64)


def test_serve_refuses_an_inference_body_past_the_inference_limit_before_reading_it(tmp_path: Path) -> None:
    with ScriptedServer("ok", cycle=True) as upstream, serving(tmp_path, upstream.base_url) as url:
        port = httpx.URL(url).port
        assert first_answer(port, INFERENCE, 250 * MIB, 1).startswith(
            b"HTTP/1.1 413"
        )  # under serve's 256 MiB
        assert first_answer(port, INFERENCE, 33 * MIB, 1).startswith(b"HTTP/1.1 413")


def test_the_gateway_refuses_bodies_past_its_limit_declared_or_streamed() -> None:
    with ScriptedServer("ok", cycle=True) as upstream:
        gateway = Gateway(SlowEngine(upstream)).start()  # type: ignore[arg-type]
        try:
            assert first_answer(gateway.port, gateway.api_key, 1 << 30, 1).startswith(b"HTTP/1.1 413")

            def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
                for _ in range(40):
                    yield b" " * MIB

            answer = httpx.post(
                f"{gateway.base_url}/chat/completions",
                content=chunks(),
                headers={"authorization": f"Bearer {gateway.api_key}"},
                timeout=30,
            )
            assert answer.status_code == 413
        finally:
            gateway.stop()


def test_record_mode_refuses_deep_bodies_and_matches_long_conversations_once(tmp_path: Path) -> None:
    recorder = LiveRecorder(open_store(str(tmp_path / "t.db")))
    headers = {"authorization": f"Bearer {INFERENCE}"}
    with (
        ScriptedServer("ok", cycle=True) as upstream,
        serving(tmp_path, upstream.base_url, record=recorder) as url,
    ):
        bomb = b'{"model": "nobody", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        answer = httpx.post(f"{url}/v1/chat/completions", content=bomb, headers=headers, timeout=60)
        assert answer.status_code == 400 and "nested" in answer.text
    assert recorder._conversation([{"role": "user", "content": str(i)} for i in range(100)])  # a new id
    too_long = [{"role": "user", "content": str(i)} for i in range(MAX_CHAINED_MESSAGES + 1)]
    assert recorder._conversation(too_long) != recorder._conversation(
        too_long
    )  # never matched: new each time


def test_a_reward_body_nested_too_deeply_is_a_400(tmp_path: Path) -> None:
    recorder = LiveRecorder(open_store(str(tmp_path / "t.db")))
    with (
        ScriptedServer("ok", cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        answer = httpx.post(
            f"http://127.0.0.1:{ep.port}/rewards/t1",
            content=b"[" * 60_000,
            headers={"authorization": f"Bearer {recorder.require_key()}"},
            timeout=30,
        )
    assert answer.status_code == 400 and "nested too deeply" in answer.text


class FailingReload(SlowEngine):
    """An engine whose second load of `@1` fails as VLLMServer.load_lora does: naming the adapter's path."""

    async def load_lora(self, name: str, path: Any) -> Any:
        if name.endswith("@1") and name in self.loaded:
            raise FileNotFoundError(2, "No such file or directory", str(Path(path) / "adapter_config.json"))
        return await super().load_lora(name, path)


async def test_the_gateways_404_for_a_version_that_did_not_load_names_no_path() -> None:
    with ScriptedServer("ok", cycle=True) as upstream:
        engine = FailingReload(upstream)
        gateway = Gateway(engine).start()  # type: ignore[arg-type]
        gateway.keep_old_s = 0
        try:
            secret = "/srv/secret-team/.art/proj/models/agent/checkpoints"
            await gateway.publish("proj/agent", "agent", 1, Path(f"{secret}/0001"))
            await gateway.publish("proj/agent", "agent", 2, Path(f"{secret}/0002"))
            for _ in range(100):  # @1 retired (its grace is 0)
                if "proj/agent@1" in engine.unloaded:
                    break
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(
                    f"{gateway.base_url}/chat/completions",
                    headers={"authorization": f"Bearer {gateway.api_key}"},
                    json={"model": "agent@1", "messages": [{"role": "user", "content": "x"}]},
                )
            assert answer.status_code == 404 and "secret-team" not in answer.text and "agent@1" in answer.text
        finally:
            gateway.stop()


async def test_the_recording_endpoint_cancels_the_upstream_when_its_agent_hangs_up() -> None:
    seen: list[str] = []

    async def chat(request: Request) -> JSONResponse:
        await request.body()
        for _ in range(300):  # generating for up to 30 s
            if await request.is_disconnected():
                seen.append("cancelled")
                return JSONResponse({})
            await asyncio.sleep(0.1)
        seen.append("generated to the end")
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with running(app) as upstream, RecordingEndpoint(f"{upstream}/v1", request_token_ids=False) as endpoint:
        async with art.capture():
            with pytest.raises(httpx.TimeoutException):
                async with httpx.AsyncClient(timeout=0.5) as client:
                    await client.post(
                        endpoint.url() + "/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                    )
            for _ in range(200):
                if seen:
                    break
                await asyncio.sleep(0.05)
    assert seen == ["cancelled"]


async def test_the_recording_endpoints_502_shows_no_credentials_of_the_upstream() -> None:
    with RecordingEndpoint("http://svc:UPSTREAM-PASSWORD@127.0.0.1:9/v1?key=QUERY-KEY") as endpoint:
        async with art.capture():
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(
                    endpoint.url() + "/chat/completions", json={"model": "m", "messages": []}
                )
    assert answer.status_code == 502 and "127.0.0.1:9" in answer.text
    assert "UPSTREAM-PASSWORD" not in answer.text and "QUERY-KEY" not in answer.text
    assert json.loads(answer.text)["error"]["message"].startswith("the model's endpoint")
