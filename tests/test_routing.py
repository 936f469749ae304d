"""Rollout-sticky routing: the recording client names each rollout to our backend, and the gateway sends all of a
rollout's calls to one engine: a replica of the managed server, or a vLLM server of another host that loaded the
version before anything was routed to it. Settings that cannot work (replicas that do not fit the GPUs) are
refused before anything starts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import art_adapters as art
from art_adapters.calls import ROLLOUT_HEADER
from art_adapters.capture.scope import rollout_key
from art_adapters.capture.transport import AsyncRecordingTransport
from art_adapters.inference import InferenceConfig
from art_adapters.inference.config import RemoteEngine
from art_adapters.inference.routing import DP_RANK_HEADER, MANAGED, PeerEngine, choose, pick, route
from test_remote_backend import running


def test_a_key_always_picks_the_same_engine_and_keys_spread() -> None:
    keys = [f"rollout-{k}" for k in range(400)]
    assert all(pick(k, 3) == pick(k, 3) for k in keys)
    counts = [sum(pick(k, 3) == i for k in keys) for i in range(3)]
    assert min(counts) > 100, counts
    moved = sum(
        pick(k, 3) != pick(k, 4) for k in keys
    )  # a fourth engine takes about a quarter, moves no other
    assert all(pick(k, 4) in (pick(k, 3), 3) for k in keys) and 60 < moved < 140


class _Server:
    def __init__(self, replicas: int, peers: list[PeerEngine] | None = None) -> None:
        self.config = InferenceConfig(replicas=replicas)
        self.base_url, self.api_key, self.peers = "http://127.0.0.1:1/v1", "engine-key", peers or []


def test_route_names_a_replica_and_a_host() -> None:
    assert route(_Server(1), "r").headers == {} and route(_Server(1), None).base_url.endswith(":1/v1")
    two = route(_Server(2), "r")
    assert two.headers == {DP_RANK_HEADER: str(pick("r/replica", 2))} and two.api_key == "engine-key"
    peer = PeerEngine(
        RemoteEngine(url="http://host-b:8000/v1/", replicas=2, path_map={"/a/.art": "/mnt/.art"})
    )
    server = _Server(1, [peer])
    chosen = {key: route(server, key) for key in ("a", "b", "c", "d", "e", "f")}
    assert {u.base_url for u in chosen.values()} == {"http://127.0.0.1:1/v1", "http://host-b:8000/v1"}
    for key, upstream in chosen.items():
        assert (upstream.peer is peer) == (choose(key, [MANAGED, peer.base_url]) == 1)
        if upstream.peer is peer:
            assert upstream.headers == {DP_RANK_HEADER: str(pick(f"{key}/replica", 2))}
    assert (
        peer.remote_path(Path("/a/.art/p/models/m/checkpoints/0001"))
        == "/mnt/.art/p/models/m/checkpoints/0001"
    )
    assert peer.remote_path(Path("/a/.artist/x")) == "/a/.artist/x"  # a prefix of a name is not a folder
    peer.healthy = False
    assert all(route(server, key).peer is None for key in chosen)


def test_replicas_must_fit_the_gpus() -> None:
    assert InferenceConfig(replicas=2, gpu_ids=[0, 1]).replicas == 2
    assert InferenceConfig(replicas=2, gpu_ids=[0, 1, 2, 3]).replicas == 2  # two GPUs each (tensor parallel)
    with pytest.raises(ValidationError, match="replicas=2 needs a multiple of 2 gpu_ids"):
        InferenceConfig(replicas=2, gpu_ids=[0])


def test_serve_passes_replicas_and_inference_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from art_adapters.backend import launch, local

    made: list[Any] = []

    class Recorder:
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

    monkeypatch.setattr(local, "LocalBackend", Recorder)

    class NoServer:
        def __init__(self, config: Any) -> None:
            pass

        def run(self) -> None:
            pass

    monkeypatch.setattr(uvicorn, "Server", NoServer)
    monkeypatch.setattr(launch, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(launch, "uvicorn_config", lambda *a, **k: None)
    launch.serve_command(
        ["--replicas", "2", "--inference-gpu", "2", "--inference-gpu", "3", "--trainer-hsdp"]
    )
    inference = made[0]["inference"]
    assert inference.replicas == 2 and inference.gpu_ids == [2, 3] and made[0]["trainer_options"].hsdp
    with pytest.raises(SystemExit, match="replicas=2 needs a multiple of 2 gpu_ids"):
        launch.serve_command(["--replicas", "2", "--inference-gpu", "0"])


async def test_the_recording_client_names_the_rollout_to_our_backend_only() -> None:
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"choices": []})

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ours = httpx.AsyncClient(
        transport=AsyncRecordingTransport(httpx.MockTransport(answer), request_token_ids=True)
    )
    theirs = httpx.AsyncClient(transport=AsyncRecordingTransport(httpx.MockTransport(answer)))
    async with art.capture() as first:
        await ours.post("http://x/v1/chat/completions", json=body)
        await ours.post("http://x/v1/chat/completions", json=body)
        await theirs.post("http://x/v1/chat/completions", json=body)
    async with art.capture() as second:
        await ours.post("http://x/v1/chat/completions", json=body)
    await ours.post("http://x/v1/chat/completions", json=body)  # outside any rollout
    keys = [h.get(ROLLOUT_HEADER) for h in seen]
    assert keys == [rollout_key(first), rollout_key(first), None, rollout_key(second), None]
    assert rollout_key(first) != rollout_key(second)


# --- another host's engine, beside the real vLLM server ------------------------------------------------------------


def fake_engine(events: list[tuple[str, Any]], *, refuse_loads: bool = False) -> Starlette:
    """Another host's vLLM server as the gateway sees it: LoRA loading, and chat answers saying who answered."""

    async def load(request: Request) -> JSONResponse:
        body = await request.json()
        events.append(("load", body))
        return JSONResponse({"error": "no such path"}, status_code=400) if refuse_loads else JSONResponse({})

    async def unload(request: Request) -> JSONResponse:
        events.append(("unload", await request.json()))
        return JSONResponse({})

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        events.append(("chat", {"model": body["model"], "key": request.headers.get("authorization")}))
        message = {"role": "assistant", "content": "from the other host"}
        return JSONResponse(
            {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )  # fmt: skip

    return Starlette(
        routes=[
            Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_another_hosts_engine_gets_each_version_first_and_whole_rollouts(
    vllm_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fixtures_vllm import registered_on

    events: list[tuple[str, Any]] = []
    monkeypatch.setenv("HOST_B_KEY", "host-b-key")
    with running(fake_engine(events)) as url:
        peer = PeerEngine(
            RemoteEngine(url=f"{url}/v1", api_key_env="HOST_B_KEY", path_map={str(tmp_path): "/mnt/shared"})
        )
        vllm_server.peers.append(peer)
        try:
            async with registered_on(vllm_server, tmp_path, name="routed", project="hosts") as (_, model):
                loads = [body for kind, body in events if kind == "load"]
                assert loads and loads[0]["lora_path"].startswith(
                    "/mnt/shared/hosts/models/routed/checkpoints/"
                )
                client = model.openai_client()
                where: dict[str, set[str]] = {}
                for k in range(8):  # sequential rollouts of 3 turns each
                    hosts: set[str] = set()
                    async with art.capture() as trajectory:
                        messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello {k}"}]
                        for _ in range(3):
                            reply = await client.chat.completions.create(
                                model=model.get_inference_name(), messages=messages, max_tokens=2
                            )
                            text = reply.choices[0].message.content or ""
                            hosts.add("host b" if text == "from the other host" else "host a")
                            messages += [
                                {"role": "assistant", "content": text},
                                {"role": "user", "content": "go on"},
                            ]
                    where[rollout_key(trajectory)] = hosts
                for key, hosts in where.items():
                    on_b = choose(key, [MANAGED, peer.base_url]) == 1
                    assert hosts == {"host b" if on_b else "host a"}, (key, hosts)
                chats = [body for kind, body in events if kind == "chat"]
                assert chats and all(c["key"] == "Bearer host-b-key" and "@0" in c["model"] for c in chats)
                assert events.index(("chat", chats[0])) > events.index(("load", loads[0]))
            for _ in range(200):  # unloads there run in the background: a while (bounded) to arrive
                if [body for kind, body in events if kind == "unload"]:
                    break
                await asyncio.sleep(0.05)
        finally:
            vllm_server.peers.remove(peer)
    assert [body["lora_name"] for kind, body in events if kind == "unload"]  # forgotten on close, there too


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_an_engine_that_cannot_load_a_version_is_not_routed_to(
    vllm_server: Any, tmp_path: Path
) -> None:
    from fixtures_vllm import registered_on

    events: list[tuple[str, Any]] = []
    with running(fake_engine(events, refuse_loads=True)) as url:
        peer = PeerEngine(RemoteEngine(url=f"{url}/v1"))
        vllm_server.peers.append(peer)
        try:
            async with registered_on(vllm_server, tmp_path, name="refused", project="hosts") as (_, model):
                assert not peer.healthy
                client = model.openai_client()
                replies = await asyncio.gather(
                    *(
                        client.chat.completions.create(
                            model=model.get_inference_name(),
                            messages=[{"role": "user", "content": str(k)}],
                            max_tokens=1,
                        )
                        for k in range(6)
                    )
                )
                assert all(r.choices[0].message.content != "from the other host" for r in replies)
                assert not [e for e in events if e[0] == "chat"]
        finally:
            vllm_server.peers.remove(peer)
