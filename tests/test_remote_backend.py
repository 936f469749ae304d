"""RemoteBackend against the real server (uvicorn on 127.0.0.1) over a FakeBackend: the whole loop, the proxy,
streamed progress and clear errors. FakeBackend and `running` are shared with the other server tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import art_adapters as art
from art_adapters.backend.base import Backend, InferenceEndpoint
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer

UPSTREAM_KEY = "vllm-secret-key"


class FakeBackend:
    """The Backend protocol in memory + files: checkpoints `.../checkpoints/{step:04d}/` written atomically
    (a `.tmp-*` dir, then rename); inference is a ScriptedServer (`inference_url`)."""

    def __init__(
        self, path: str | Path, inference_url: str, *, step_delay_s: float = 0.0, events: int = 3
    ) -> None:
        self.path = Path(path)
        self.inference_url = inference_url
        self.step_delay_s = step_delay_s
        self.events = events
        self.calls: list[tuple[str, str]] = []
        self.fail_train: str | None = None
        for stale in self.path.glob("*/models/*/checkpoints/.tmp-*"):  # a step killed before its rename
            shutil.rmtree(stale)

    def model_dir(self, model: art.Model) -> Path:
        return self.path / model.project / "models" / model.name

    def checkpoints(self, model: art.Model) -> list[int]:
        folder = self.model_dir(model) / "checkpoints"
        return sorted(int(p.name) for p in folder.glob("[0-9]*") if p.is_dir()) if folder.exists() else []

    async def register(self, model: art.Model) -> InferenceEndpoint:
        self.calls.append(("register", model.name))
        folder = self.model_dir(model)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.json").write_text(model.model_dump_json())
        return InferenceEndpoint(base_url=self.inference_url, api_key=UPSTREAM_KEY, model_name=model.name)

    async def get_step(self, model: art.TrainableModel) -> int:
        self.calls.append(("get_step", model.name))
        return max(self.checkpoints(model), default=0)

    async def train_events(
        self,
        model: art.TrainableModel,
        groups: list[art.TrajectoryGroup],
        config: art.TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("train", model.name))
        step = max(self.checkpoints(model), default=0) + 1
        rewards = [t.reward for g in groups for t in g.trajectories]
        for i in range(self.events):
            await asyncio.sleep(self.step_delay_s)
            if self.fail_train:
                raise RuntimeError(self.fail_train)
            yield {"event": "progress", "step": step, "i": i, "t": time.time()}
        folder = self.model_dir(model) / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{step:04d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        payload = json.dumps({"step": step, "rewards": rewards, "lr": config.learning_rate})
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            with (tmp / name).open("w") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        await asyncio.sleep(self.step_delay_s)  # a window in which the step is half-written
        os.rename(tmp, folder / f"{step:04d}")
        metrics = {"step": step, "reward_mean": sum(rewards) / max(len(rewards), 1), "n": len(rewards)}
        yield {"event": "done", "step": step, "metrics": metrics}

    async def train_sft_events(
        self, model: art.TrainableModel, trajectories: list[art.Trajectory], config: art.SFTConfig
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("train_sft", model.name))
        yield {"event": "progress", "batch": 0}
        yield {"event": "done", "metrics": {"sft_examples": len(trajectories), "epochs": config.epochs}}

    async def log(
        self,
        model: art.Model,
        groups: list[art.TrajectoryGroup],
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        self.calls.append(("log", model.name))
        rewards = [t.reward for g in groups for t in g.trajectories]
        return {f"{split}/reward_mean": sum(rewards) / max(len(rewards), 1)}

    async def delete_checkpoints(
        self, model: art.TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        self.calls.append(("delete_checkpoints", model.name))
        steps = self.checkpoints(model)
        doomed = steps[:-1]
        for step in doomed:
            shutil.rmtree(self.model_dir(model) / "checkpoints" / f"{step:04d}")
        return doomed

    async def close(self) -> None:
        self.calls.append(("close", ""))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running(app: Any, port: int | None = None) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 in a thread of its own; yields the base URL."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=2048)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    with ScriptedServer(None) as server:  # echoes the last user message
        yield server


@pytest.fixture
def fake(tmp_path: Path, scripted: ScriptedServer) -> FakeBackend:
    return FakeBackend(tmp_path / "art", scripted.base_url)


@pytest.fixture
def served(fake: FakeBackend) -> Iterator[str]:
    with running(
        create_app(fake, api_key="server-key", heartbeat_s=0.2, allowed_base_models=["tiny"])
    ) as url:
        yield url


def trainable(name: str = "agent-1") -> art.TrainableModel:
    return art.TrainableModel(name=name, project="proj", base_model="tiny")


def group(rewards: list[float]) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r) for r in rewards
    )


def openai_client(model: art.Model) -> Any:
    """The model's recording client when that module exists, else a plain AsyncOpenAI on its endpoint."""
    try:
        return model.openai_client()
    except ImportError:
        import openai

        return openai.AsyncOpenAI(
            base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0
        )


def test_fake_backend_is_a_backend(fake: FakeBackend) -> None:
    assert isinstance(fake, Backend)
    assert isinstance(RemoteBackend("http://x"), Backend)


async def test_training_loop_through_remote_backend(
    served: str, fake: FakeBackend, scripted: ScriptedServer
) -> None:
    backend = RemoteBackend(served, api_key="server-key")
    model = trainable()
    await model.register(backend)
    assert model.inference_base_url == f"{served}/v1"
    assert (
        model.inference_api_key and model.inference_api_key != "server-key"
    )  # rollouts get the inference key
    assert await model.get_step() == 0

    answer = await openai_client(model).chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "ping"}]
    )
    assert answer.choices[0].message.content == "echo: ping"
    assert scripted.requests[-1]["model"] == "agent-1"

    metrics = await model.train([group([0.0, 1.0]), group([1.0, 1.0])], art.TrainConfig(learning_rate=1e-5))
    assert metrics == {"step": 1, "reward_mean": 0.75, "n": 4}
    assert await model.get_step() == 1
    assert (await model.train([group([1.0])]))["step"] == 2
    assert (
        json.loads((fake.model_dir(model) / "checkpoints/0002/adapter_config.json").read_text())["lr"] == 5e-6
    )

    sft = await model.train_sft([art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}])])
    assert sft == {"sft_examples": 1, "epochs": 1}
    assert await model.log([group([0.5, 1.0])]) == {"val/reward_mean": 0.75}
    assert await model.delete_checkpoints() == [1]
    assert fake.checkpoints(model) == [2]
    await backend.close()


async def test_streaming_chat_and_models_through_proxy(served: str) -> None:
    backend = RemoteBackend(served, api_key="server-key")
    model = trainable()
    await model.register(backend)
    stream = await openai_client(model).chat.completions.create(
        model="agent-1@1", messages=[{"role": "user", "content": "a long enough message"}], stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "echo: a long enough message"
    async with httpx.AsyncClient(headers={"authorization": "Bearer server-key"}) as client:
        listed = (await client.get(f"{served}/v1/models")).json()
    # the registered model's names, from the server's own table: never the upstream's base model or its paths
    assert [m["id"] for m in listed["data"]] == ["agent-1", "proj/agent-1"]
    assert set(listed["data"][0]) == {"id", "object", "owned_by"}


async def test_proxy_swaps_in_the_upstream_key(fake: FakeBackend) -> None:
    seen: list[httpx.Request] = []

    class Body(httpx.AsyncByteStream):  # a live stream, as a real transport returns
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b'{"ok": true}'

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body())

    app = create_app(fake, api_key="server-key", allowed_base_models=["tiny"])
    app.state.art.proxy._client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        auth = {"authorization": "Bearer server-key"}
        await client.post(
            "/models/register", json={"model": trainable().model_dump(mode="json")}, headers=auth
        )
        response = await client.post(
            "/v1/chat/completions?x=1", json={"model": "agent-1", "messages": []}, headers=auth
        )
    assert response.json() == {"ok": True}
    assert seen[0].headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert str(seen[0].url) == f"{fake.inference_url}/chat/completions?x=1"


async def test_progress_arrives_while_the_step_runs(served: str, fake: FakeBackend) -> None:
    fake.step_delay_s = 0.3
    backend = RemoteBackend(served, api_key="server-key")
    model = trainable()
    await model.register(backend)
    arrivals: list[tuple[str, float, float]] = []
    async for event in backend.train_events(model, [group([1.0])], art.TrainConfig()):
        arrivals.append((event["event"], event.get("t", 0.0), time.time()))
    assert [a[0] for a in arrivals] == ["progress"] * 3 + ["done"]
    first_received = arrivals[0][2]
    assert first_received < arrivals[-1][2] - 0.5  # not buffered until the end
    assert all(e[0] != "heartbeat" for e in arrivals)  # heartbeats (0.2 s) are swallowed by the client
    body = {"model": model.model_dump(mode="json"), "groups": [group([1.0]).model_dump(mode="json")]}
    async with httpx.AsyncClient(headers={"authorization": "Bearer server-key"}) as client:
        raw = await client.post(f"{served}/models/train", json=body)
    assert raw.headers["content-type"] == "application/x-ndjson"
    kinds = [json.loads(line)["event"] for line in raw.text.splitlines()]
    assert "heartbeat" in kinds and kinds[-1] == "done"


async def test_errors_are_clear(served: str, fake: FakeBackend) -> None:
    model = trainable()
    with pytest.raises(RemoteBackendError, match="bad or missing API key") as info:
        await model.register(RemoteBackend(served, api_key="wrong"))
    assert info.value.status == 401

    backend = RemoteBackend(served, api_key="server-key")
    await model.register(backend)
    fake.fail_train = "out of GPU memory"
    with pytest.raises(
        RemoteBackendError, match="train of model 'agent-1' failed on the server: RuntimeError: out"
    ):
        await model.train([group([1.0])])

    bad = group([1.0]).model_dump(mode="json")
    bad["trajectories"][0]["reward"] = "high"
    with pytest.raises(
        RemoteBackendError,
        match=r"422 invalid request: body\.groups\.0\.(trajectories\.0\.)?reward: Input should be a valid number",
    ):
        await backend._post("/models/train", {"model": model.model_dump(mode="json"), "groups": [bad]})

    with pytest.raises(RemoteBackendError, match="cannot reach the art-adapters server"):
        await RemoteBackend(f"http://127.0.0.1:{free_port()}").get_step(model)

    async with httpx.AsyncClient(headers={"authorization": "Bearer server-key"}) as client:
        response = await client.post(f"{served}/v1/chat/completions", content=b"{bad json")
    assert (
        response.status_code == 400
        and response.json()["error"]["message"] == "request body is not valid JSON"
    )
    await backend.close()


async def test_plain_model_is_reached_directly_and_api_key_from_env(
    served: str, scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ART_ADAPTERS_API_KEY", "server-key")
    model = art.Model(name="judge", project="proj", inference_base_url="http://169.254.169.254/v1")
    await model.register(RemoteBackend(served))
    assert model.inference_base_url == scripted.base_url  # what the backend said, not the server's proxy
    async with httpx.AsyncClient(headers={"authorization": "Bearer server-key"}) as client:
        response = await client.post(f"{served}/v1/chat/completions", json={"model": "judge", "messages": []})
    assert response.status_code == 404  # the server relays only to what its backend serves
    assert "not registered" in response.json()["error"]["message"]


async def test_an_out_of_process_agent_is_recorded_through_serve_behind_its_key(served: str) -> None:
    """The recording endpoint in front of `serve`: the agent (a subprocess) holds no key, the proxy sees ours."""
    import subprocess
    import sys

    backend = RemoteBackend(served, api_key="server-key")
    model = trainable()
    await model.register(backend)
    agent = Path(__file__).parent / "agents" / "openai_tool_loop.py"
    with art.RecordingEndpoint(model.inference_base_url, model.inference_api_key) as endpoint:
        async with art.capture() as trajectory:
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, str(agent), endpoint.url(), model.get_inference_name()],
                capture_output=True,
                text=True,
                timeout=60,
            )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"answer": "echo: Weather in Oslo?"}
    (call,) = trajectory.llm_calls
    assert call.completion_token_ids and call.request["model"] == "agent-1"
    await backend.close()
