"""The recording endpoint from an attacker's side: a rollout URL (on an agent's argv, readable by every local user)
tried against routes it was not given, with encoded `..`, huge and deeply nested bodies, odd headers and foreign Host
names. It forwards only the recorded routes, and never carries serve's admin key."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.capture.endpoint import RecordingEndpoint
from test_remote_backend import FakeBackend, running, trainable

ADMIN = "admin-key-1"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Upstream:
    """Any route answers 200 and is remembered (a third party's API: files, fine-tuning, ...)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # (the endpoint's key check at start aside)

    def app(self) -> Starlette:
        async def anything(request: Request) -> JSONResponse:
            if (request.method, request.url.path) != ("GET", "/v1/models"):
                self.seen.append((request.method, request.url.path, dict(request.headers)))
            message = {"role": "assistant", "content": "ok"}
            return JSONResponse({"id": "c", "object": "chat.completion", "choices": [{"message": message}]})

        return Starlette(routes=[Route("/{path:path}", anything, methods=["GET", "POST", "DELETE"])])


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    recorder = Upstream()
    with running(recorder.app()) as url:
        yield recorder, f"{url}/v1"


def raw(port: int, request: bytes) -> bytes:
    """Send bytes as they are (no client normalizes `%2e%2e`), return the answer's first line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(65536).split(b"\r\n", 1)[0]


async def test_a_rollout_url_reaches_only_the_recorded_routes(upstream: tuple[Upstream, str]) -> None:
    recorder, url = upstream
    with RecordingEndpoint(url, "third-party-key") as endpoint:
        async with art.capture() as trajectory:
            base = endpoint.url()
            path = base.split(str(endpoint.port), 1)[1]
            for method, tail in [
                ("POST", "/%2e%2e/models/delete_checkpoints"),
                ("POST", "/chat/completions/%2e%2e/%2e%2e/files"),
                ("POST", "/%2E%2E%2fmodels"),
                ("GET", "/files"),
                ("POST", "/fine_tuning/jobs"),
                ("DELETE", "/models/ft-1"),
                ("GET", "/chat/completions"),
                ("POST", "/chat/completions/"),
                ("POST", "//chat/completions"),
            ]:
                head = f"{method} {path}{tail} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 2\r\n\r\n{{}}"
                status = raw(endpoint.port, head.encode())
                assert status.split(b" ")[1] in (b"404", b"405"), (method, tail, status)
            async with httpx.AsyncClient() as client:
                ok = await client.post(f"{base}/chat/completions", json=CHAT)
    assert ok.status_code == 200 and len(trajectory.llm_calls) == 1
    assert [(m, p) for m, p, _ in recorder.seen] == [("POST", "/v1/chat/completions")]


async def test_serve_s_admin_key_is_never_carried(tmp_path: Path) -> None:
    """With serve's admin key, `.../v1/%2e%2e/models/delete_checkpoints` deleted checkpoints. An endpoint given
    the admin key refuses to start; given the inference key serve hands out, it records as before."""
    with art.testing.ScriptedServer(None) as inference:
        fake = FakeBackend(tmp_path / "art", inference.base_url)
        with running(create_app(fake, api_key=ADMIN, allowed_base_models=["tiny"])) as url:
            body = {"model": trainable().model_dump(mode="json")}
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {ADMIN}"}) as admin:
                handed = await admin.post(f"{url}/models/register", json=body)
            with pytest.raises(PermissionError, match="admin key"):
                RecordingEndpoint(f"{url}/v1", ADMIN).start()
            assert [c for c in fake.calls if c[0] == "delete_checkpoints"] == []
            with RecordingEndpoint(f"{url}/v1", handed.json()["api_key"]) as endpoint:
                async with art.capture() as trajectory:
                    async with httpx.AsyncClient() as client:
                        ask = {**CHAT, "model": "agent-1"}
                        ok = await client.post(f"{endpoint.url()}/chat/completions", json=ask)
    assert ok.status_code == 200 and len(trajectory.llm_calls) == 1


async def test_bodies_are_bounded_and_deep_json_is_a_clear_400(upstream: tuple[Upstream, str]) -> None:
    """The endpoint read bodies of any size, and a body nested 100,000 deep raised in the recorder."""
    recorder, url = upstream
    with RecordingEndpoint(url, max_body_bytes=4096) as endpoint:
        async with art.capture() as trajectory:
            base = endpoint.url()
            async with httpx.AsyncClient(timeout=30) as client:
                big = await client.post(f"{base}/chat/completions", content=b'{"x": "' + b"a" * 8000 + b'"}')

                async def chunks() -> Any:  # no content-length: counted as it arrives
                    for _ in range(8):
                        yield b" " * 1024

                streamed = await client.post(f"{base}/chat/completions", content=chunks())
                deep = await client.post(f"{base}/chat/completions", content=b"[" * 2000 + b"]" * 2000)
                not_json = await client.post(f"{base}/chat/completions", content=b"\x80\x04pickle")
                array = await client.post(f"{base}/chat/completions", json=[1, 2])
                ok = await client.post(f"{base}/chat/completions", json=CHAT)
    assert big.status_code == streamed.status_code == 413
    assert deep.status_code == 400 and "nested deeper" in deep.text
    assert not_json.status_code == array.status_code == 400
    assert ok.status_code == 200 and len(trajectory.llm_calls) == 1 and len(recorder.seen) == 1


async def test_odd_headers_and_foreign_host_names(upstream: tuple[Upstream, str]) -> None:
    """A non-ASCII header answered 500; vLLM's own headers went upstream; a page whose name was rebound to
    127.0.0.1 could use the shared base URL."""
    recorder, url = upstream
    with RecordingEndpoint(url, "k") as endpoint:
        async with art.capture():
            rollout = endpoint.rollout_id()
            async with httpx.AsyncClient(timeout=30) as client:
                headers = [
                    (b"x-art-rollout", rollout.encode()),
                    (b"user-agent", "agént".encode("latin-1")),
                    (b"x-request-id", b"someone-elses"),
                    (b"x-data-parallel-rank", b"3"),
                ]
                odd = await client.post(f"{endpoint.base_url}/chat/completions", json=CHAT, headers=headers)
                rebound = await client.post(
                    f"{endpoint.base_url}/chat/completions",
                    json=CHAT,
                    headers={"x-art-rollout": rollout, "host": "attacker.example"},
                )
    assert odd.status_code == 200 and rebound.status_code == 403
    ((_, _, sent),) = recorder.seen
    assert sent["authorization"] == "Bearer k"
    assert not {"x-request-id", "x-data-parallel-rank"} & set(sent)
    assert sent.get("x-art-rollout") != rollout  # the capability stays here (our client names it opaquely)
    assert "agént" not in str(sent)
