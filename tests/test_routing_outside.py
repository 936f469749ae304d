"""Routing to other hosts' engines when things go wrong there: an engine that leaves moves only its own rollouts;
a peer without a key is reached without one; a peer that dies is taken out at the first request it cannot take
(which goes to another engine) and comes back once it loads the versions again; a peer that hangs on unload never
stalls a publish; `path_map` maps the path as the user named it (through a symlink too), longest prefix first.
Peers are real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_adapters.calls import ROLLOUT_HEADER
from art_adapters.inference import InferenceConfig
from art_adapters.inference.config import RemoteEngine
from art_adapters.inference.gateway import Gateway
from art_adapters.inference.routing import (
    MANAGED,
    UNLOAD_FAILURES,
    PeerEngine,
    choose,
    load_on_peers,
    route,
    unload_on_peers,
)
from art_adapters.inference.vllm_server import VLLMServer
from test_remote_backend import free_port, running


def engine(label: str, events: list[tuple[str, Any]], *, unload: Any = None) -> Starlette:
    """An engine answering chats with `label`; it records loads, unloads and the authorization it was sent."""

    async def load(request: Request) -> JSONResponse:
        events.append(("load", await request.json()))
        return JSONResponse({})

    async def unload_route(request: Request) -> JSONResponse:
        events.append(("unload", await request.json()))
        return await unload() if unload is not None else JSONResponse({})

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        events.append(("chat", request.headers.get("authorization")))
        message = {"role": "assistant", "content": label}
        return JSONResponse(
            {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )  # fmt: skip

    return Starlette(
        routes=[
            Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_route, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


class FakeServer:
    """The managed server as the gateway sees it (its engine a real HTTP server), its peers loaded like VLLMServer's."""

    def __init__(self, url: str, peers: list[PeerEngine]) -> None:
        self.config = InferenceConfig(max_model_len=256)
        self.base_url, self.api_key, self.peers = url + "/v1", "k", peers
        self.loras: dict[str, Path] = {}
        self.died, self.running, self.process, self.restarts, self.log_path = False, True, None, 0, "-"

    async def load_lora(self, name: str, path: Path) -> float:
        await load_on_peers(self.peers, name, path, served=lambda: dict(self.loras))
        self.loras[name] = path
        return 0.0

    async def unload_lora(self, name: str) -> None:
        self.loras.pop(name, None)
        await unload_on_peers(self.peers, name)


def chat(gateway: Gateway, key: str) -> httpx.Response:
    body = {"model": "p/m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {gateway.api_key}", ROLLOUT_HEADER: key}
    return httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers, timeout=60)


def key_on(peer: PeerEngine, others: list[str]) -> str:
    """A rollout key that rendezvous hashing sends to `peer` among `others` and it."""
    names = [*others, peer.base_url]
    return next(f"r{i}" for i in range(1000) if choose(f"r{i}", names) == len(names) - 1)


def test_losing_an_engine_moves_only_its_rollouts() -> None:
    a = PeerEngine(RemoteEngine(url="http://host-a:8000/v1"))
    b = PeerEngine(RemoteEngine(url="http://host-b:8000/v1"))
    server = FakeServer("http://127.0.0.1:9", [a, b])
    keys = [f"rollout-{i}" for i in range(2000)]
    before = {k: route(server, k).base_url for k in keys}
    assert len(set(before.values())) == 3
    a.healthy = False
    after = {k: route(server, k).base_url for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != a.base_url)
    assert all(after[k] != a.base_url for k in keys)
    a.healthy = True
    assert {k: route(server, k).base_url for k in keys} == before  # back where they were
    server.peers = [b, a]  # the order peers are listed in does not matter either
    assert {k: route(server, k).base_url for k in keys} == before


def test_a_peer_that_lacks_the_version_is_not_routed_to_for_it() -> None:
    peer = PeerEngine(RemoteEngine(url="http://host-a:8000/v1"))
    peer.loras["p/m@1"] = "/x"
    server = FakeServer("http://127.0.0.1:9", [peer])
    key = key_on(peer, [MANAGED])
    assert route(server, key, "p/m@1").peer is peer
    assert route(server, key, "p/m@2").peer is None


def test_a_peer_without_a_key_is_sent_no_authorization(tmp_path: Path) -> None:
    managed_events: list[tuple[str, Any]] = []
    peer_events: list[tuple[str, Any]] = []
    with running(engine("managed", managed_events)) as managed, running(engine("peer", peer_events)) as url:
        peer = PeerEngine(RemoteEngine(url=url + "/v1"))
        gateway = Gateway(FakeServer(managed, [peer])).start()
        try:
            asyncio.run(gateway.publish("p/m", "m", 1, tmp_path))
            reply = chat(gateway, key_on(peer, [MANAGED]))
        finally:
            gateway.stop()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "peer"
    assert [e for e in peer_events if e[0] == "chat"] == [("chat", None)] and peer.healthy


def test_a_peer_that_dies_is_taken_out_at_once_and_back_when_it_loads_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PEER_KEY", "peer-key")
    events: list[tuple[str, Any]] = []
    port = free_port()
    with running(engine("managed", [])) as managed:
        peer_server = running(engine("peer", events), port=port)
        url = peer_server.__enter__()
        peer = PeerEngine(RemoteEngine(url=url + "/v1", api_key_env="PEER_KEY"))
        gateway = Gateway(FakeServer(managed, [peer])).start()
        try:
            asyncio.run(gateway.publish("p/m", "m", 1, tmp_path / "1"))
            key = key_on(peer, [MANAGED])
            assert chat(gateway, key).json()["choices"][0]["message"]["content"] == "peer"
            peer_server.__exit__(None, None, None)  # its host goes down
            replies = [chat(gateway, key) for _ in range(2)]
            assert [r.status_code for r in replies] == [200, 200], replies[0].text
            assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"managed"}
            assert not peer.healthy
            events.clear()
            with running(engine("peer", events), port=port):  # back (restarted: it holds nothing)
                asyncio.run(gateway.publish("p/m", "m", 2, tmp_path / "2"))
                for _ in range(400):  # it loads the versions in the background (bounded wait)
                    if peer.healthy:
                        break
                    threading.Event().wait(0.05)
                assert peer.healthy
                loaded = {body["lora_name"] for kind, body in events if kind == "load"}
                assert loaded == {"p/m@1", "p/m@2"}
                reply = chat(gateway, key)
                assert reply.json()["choices"][0]["message"]["content"] == "peer"
                assert events[-1] == ("chat", "Bearer peer-key")
        finally:
            gateway.stop()


def test_a_request_tries_each_dead_peer_once_then_the_managed_engine(tmp_path: Path) -> None:
    with running(engine("managed", [])) as managed:
        peers = []
        servers = []
        for _ in range(2):
            servers.append(running(engine("peer", [])))
            peers.append(PeerEngine(RemoteEngine(url=servers[-1].__enter__() + "/v1")))
        gateway = Gateway(FakeServer(managed, peers)).start()
        try:
            asyncio.run(gateway.publish("p/m", "m", 1, tmp_path))
            for server in servers:
                server.__exit__(None, None, None)
            keys = [key_on(peer, [MANAGED, *(p.base_url for p in peers if p is not peer)]) for peer in peers]
            replies = [chat(gateway, key) for key in keys]
        finally:
            gateway.stop()
    assert [r.status_code for r in replies] == [200, 200]
    assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"managed"}
    assert not any(p.healthy for p in peers)


@pytest.mark.asyncio
async def test_a_peer_hanging_on_unload_never_stalls_an_unload(tmp_path: Path) -> None:
    release = threading.Event()
    events: list[tuple[str, Any]] = []

    async def hang() -> JSONResponse:
        await anyio.to_thread.run_sync(release.wait, 60)
        return JSONResponse({})

    with running(engine("peer", events, unload=hang)) as url:
        peer = PeerEngine(RemoteEngine(url=url + "/v1"))
        await load_on_peers([peer], "p/m@1", tmp_path)
        assert "p/m@1" in peer.loras
        await asyncio.wait_for(unload_on_peers([peer], "p/m@1"), 5)  # returns without waiting on the peer
        assert "p/m@1" not in peer.loras and peer.healthy  # no longer routed to for that version
        pending = list(peer._unloads.values())
        assert pending
        release.set()
        await asyncio.gather(*pending)
    assert ("unload", {"lora_name": "p/m@1"}) in events and peer.unload_failures == 0


@pytest.mark.asyncio
async def test_a_peer_that_keeps_failing_unloads_is_taken_out(tmp_path: Path) -> None:
    async def refuse() -> JSONResponse:
        return JSONResponse({"error": "wedged"}, status_code=500)

    with running(engine("peer", [], unload=refuse)) as url:
        peer = PeerEngine(RemoteEngine(url=url + "/v1"))
        for step in range(UNLOAD_FAILURES):
            await load_on_peers([peer], f"p/m@{step}", tmp_path)
        for step in range(UNLOAD_FAILURES):
            await unload_on_peers([peer], f"p/m@{step}")
            assert peer.healthy
        await asyncio.gather(*peer._unloads.values())
    assert not peer.healthy and peer.unload_failures == UNLOAD_FAILURES


def test_path_map_takes_the_longest_prefix() -> None:
    peer = PeerEngine(
        RemoteEngine(url="http://b:8000/v1", path_map={"/data": "/mnt/a", "/data/art": "/mnt/b/"})
    )
    assert peer.remote_path(Path("/data/art/p/x")) == "/mnt/b/p/x"
    assert peer.remote_path(Path("/data/other")) == "/mnt/a/other"
    assert peer.remote_path(Path("/data/artist")) == "/mnt/a/artist"
    assert peer.remote_path(Path("/elsewhere/x")) == "/elsewhere/x"


@pytest.mark.asyncio
async def test_path_map_applies_to_a_folder_reached_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real" / "p" / "models" / "m" / "checkpoints" / "0001"
    real.mkdir(parents=True)
    (real / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "art").symlink_to(tmp_path / "real")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    events: list[tuple[str, Any]] = []
    with running(engine("managed", [])) as managed, running(engine("peer", events)) as url:
        spec = RemoteEngine(url=url + "/v1", path_map={str(tmp_path / "art"): "/mnt/shared/art"})
        server = VLLMServer(tmp_path / "base", InferenceConfig(remote_engines=[spec]))
        server.port = int(managed.rsplit(":", 1)[1])
        await server.load_lora("p/m@1", tmp_path / "art" / "p" / "models" / "m" / "checkpoints" / "0001")
    assert events == [
        ("load", {"lora_name": "p/m@1", "lora_path": "/mnt/shared/art/p/models/m/checkpoints/0001"})
    ]
    assert server.peers[0].healthy
