"""The server under failure: SIGKILL mid-step, clients that go away, and 512 concurrent chats through the proxy.

Run as a script it is the server of the SIGKILL test: `python tests/test_server_reliability.py PORT PATH DELAY KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from test_remote_backend import FakeBackend, free_port, group, running, trainable

KEY = "reliability-key"


def _serve_main(argv: list[str]) -> None:
    from art_adapters.backend.launch import serve
    from art_adapters.testing import Reply

    port, path, delay, key = int(argv[0]), argv[1], float(argv[2]), argv[3]
    answer_delay = float(argv[4]) if len(argv) > 4 else 0.0
    script = Reply(content="late", delay_s=answer_delay) if answer_delay else None
    with ScriptedServer([script] if script else None, cycle=bool(script)) as inference:
        backend = FakeBackend(path, inference.base_url, step_delay_s=delay)
        serve("127.0.0.1", port, key, backend=backend, log_level="warning", allowed_base_models=["tiny"])


def start_server(port: int, path: Path, delay: float, answer_delay: float = 0.0) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, str(port), str(path), str(delay), KEY, str(answer_delay)]
    proc = subprocess.Popen(command)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(
                f"http://127.0.0.1:{port}/health", headers={"authorization": f"Bearer {KEY}"}
            ).is_success:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
    proc.kill()
    raise RuntimeError("server did not come up in 60 s")


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def visible_checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "proj/models/agent-1/checkpoints").iterdir())


async def test_sigkill_mid_step_leaves_the_last_complete_checkpoint(
    tmp_path: Path, spawn: list[subprocess.Popen[bytes]]
) -> None:
    port, root = free_port(), tmp_path / "art"
    spawn.append(start_server(port, root, delay=0.25))
    backend = RemoteBackend(f"http://127.0.0.1:{port}", KEY)
    model = trainable()
    await model.register(backend)
    assert (await model.train([group([0.0, 1.0])]))["step"] == 1

    step = asyncio.create_task(model.train([group([1.0, 1.0])]))
    while not list(root.glob("proj/models/agent-1/checkpoints/.tmp-*")):  # step 2 is being written
        assert not step.done(), step
        await asyncio.sleep(0.005)
    os.kill(spawn[0].pid, signal.SIGKILL)
    with pytest.raises(
        RemoteBackendError, match=r"connection lost during train of model 'agent-1'.*get_step"
    ):
        await step
    spawn[0].wait(10)

    spawn.append(start_server(port, root, delay=0.0))
    assert await model.get_step() == 1  # read from disk: no registration needed
    assert visible_checkpoints(root) == ["0001"]
    saved = json.loads((root / "proj/models/agent-1/checkpoints/0001/adapter_model.safetensors").read_text())
    assert saved["step"] == 1 and saved["rewards"] == [0.0, 1.0]
    assert (await model.train([group([1.0])]))["step"] == 2
    assert visible_checkpoints(root) == ["0001", "0002"]
    await backend.close()


async def test_sigterm_lets_the_step_in_flight_finish(
    tmp_path: Path, spawn: list[subprocess.Popen[bytes]]
) -> None:
    port, root = free_port(), tmp_path / "art"
    spawn.append(start_server(port, root, delay=0.3))
    backend = RemoteBackend(f"http://127.0.0.1:{port}", KEY)
    model = trainable()
    await model.register(backend)
    step = asyncio.create_task(model.train([group([1.0])]))
    for _ in range(500):  # until the step is running on the server
        if (await backend.health())["training"]:
            break
        await asyncio.sleep(0.02)
    spawn[0].send_signal(signal.SIGTERM)
    assert (await step)["step"] == 1  # the stream ran to its end
    assert spawn[0].wait(30) in {0, -signal.SIGTERM}  # uvicorn re-raises the signal once shut down
    assert visible_checkpoints(root) == ["0001"]
    await backend.close()


async def test_sigterm_ends_the_server_in_bounded_time_with_requests_in_flight(
    tmp_path: Path, spawn: list[subprocess.Popen[bytes]]
) -> None:
    """A request the engine answers in 5 minutes (a 32M-token queue) kept `serve` from stopping on SIGTERM."""
    port = free_port()
    spawn.append(start_server(port, tmp_path / "art", delay=0.0, answer_delay=300.0))
    model = trainable()
    await model.register(RemoteBackend(f"http://127.0.0.1:{port}", KEY))
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "agent-1", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        pending = asyncio.create_task(client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body))
        await asyncio.sleep(1.0)
        started = time.monotonic()
        spawn[0].send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(spawn[0].wait, 60)
        assert time.monotonic() - started < 30 and code in {0, -signal.SIGTERM}
        with contextlib.suppress(httpx.HTTPError):
            await pending


def disconnect_recorder(stream_first: bytes | None) -> tuple[Any, dict[str, threading.Event]]:
    """An upstream that answers nothing (or one chunk, then nothing) and notes when its client goes away."""
    seen = {"started": threading.Event(), "gone": threading.Event()}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (message := await receive())["type"] == "http.request" and message.get("more_body"):
            pass
        seen["started"].set()
        if stream_first is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": stream_first, "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        seen["gone"].set()

    return app, seen


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_client_that_goes_away_cancels_its_upstream_request(tmp_path: Path, streamed: bool) -> None:
    """The engine stops generating for a client that left (before the answer's headers, or mid-stream): the
    proxy closes its upstream request, which is how vLLM learns to abort it."""
    app, seen = disconnect_recorder(b'data: {"choices": []}\n\n' if streamed else None)
    with running(app) as engine:
        fake = FakeBackend(tmp_path / "art", f"{engine}/v1")
        with running(create_app(fake, api_key=KEY, allowed_base_models=["tiny"])) as url:
            model = trainable()
            await model.register(RemoteBackend(url, KEY))
            body = {"model": "agent-1", "messages": [{"role": "user", "content": "hi"}], "stream": streamed}
            async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as client:
                if streamed:
                    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                        async for _ in response.aiter_raw():
                            break  # one chunk, then walk away
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        await client.post(f"{url}/v1/chat/completions", json=body, timeout=1.0)
            assert seen["started"].is_set()
            assert await asyncio.to_thread(seen["gone"].wait, 10), "the upstream request outlived its client"


async def test_server_down_is_a_clear_error() -> None:
    model = trainable()
    with pytest.raises(RemoteBackendError, match="cannot reach the art-adapters server"):
        async for _ in RemoteBackend(f"http://127.0.0.1:{free_port()}").train_events(
            model, [], art.TrainConfig()
        ):
            pass


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[str, FakeBackend]]:
    with ScriptedServer(None) as inference:
        fake = FakeBackend(tmp_path / "art", inference.base_url, step_delay_s=0.2)
        with running(create_app(fake, api_key=KEY, heartbeat_s=0.1, allowed_base_models=["tiny"])) as url:
            yield url, fake


async def test_client_that_disconnects_mid_step_corrupts_nothing(slow: tuple[str, FakeBackend]) -> None:
    url, fake = slow
    model = trainable()
    backend = RemoteBackend(url, KEY)
    await model.register(backend)
    body = {"model": model.model_dump(mode="json"), "groups": [group([1.0]).model_dump(mode="json")]}
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as client:
        async with client.stream("POST", f"{url}/models/train", json=body) as response:
            async for line in response.aiter_lines():
                if json.loads(line)["event"] == "progress":
                    break  # walk away mid-step
    # A cancelled client task does the same.
    task = asyncio.create_task(model.train([group([0.0])]))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    deadline = time.time() + 10
    while await model.get_step() < 2:  # both steps complete server-side, one after the other
        assert time.time() < deadline
        await asyncio.sleep(0.05)
    assert (await backend.health())["status"] == "ok"
    assert fake.checkpoints(model) == [1, 2]
    assert not list(fake.path.glob("**/.tmp-*"))
    assert (await model.train([group([1.0])]))["step"] == 3
    await backend.close()


async def test_concurrent_steps_of_one_model_run_one_after_the_other(slow: tuple[str, FakeBackend]) -> None:
    url, fake = slow
    backend = RemoteBackend(url, KEY)
    model = trainable()
    await model.register(backend)
    results = await asyncio.gather(*(model.train([group([float(k)])]) for k in range(3)))
    assert sorted(r["step"] for r in results) == [1, 2, 3]
    assert fake.checkpoints(model) == [1, 2, 3]
    await backend.close()


async def test_512_concurrent_chats_through_the_proxy(tmp_path: Path) -> None:
    with ScriptedServer(None) as inference:
        fake = FakeBackend(tmp_path / "art", inference.base_url)
        with running(create_app(fake, api_key=KEY, allowed_base_models=["tiny"])) as url:
            model = trainable()
            backend = RemoteBackend(url, KEY)
            await model.register(backend)
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
            async with httpx.AsyncClient(
                base_url=f"{url}/v1", headers={"authorization": f"Bearer {KEY}"}, limits=limits, timeout=60
            ) as client:

                async def chat(k: int) -> str:
                    body = {
                        "model": "agent-1",
                        "messages": [{"role": "user", "content": f"q{k}"}],
                        "stream": k % 2 == 1,
                    }
                    response = await client.post("/chat/completions", json=body)
                    response.raise_for_status()
                    if not body["stream"]:
                        return response.json()["choices"][0]["message"]["content"]
                    chunks = [
                        json.loads(x[6:]) for x in response.text.split("\n\n") if x.startswith("data: {")
                    ]
                    return "".join(
                        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
                    )

                started = time.time()
                answers = await asyncio.gather(*(chat(k) for k in range(512)), return_exceptions=True)
                elapsed = time.time() - started
            errors = [a for a in answers if isinstance(a, BaseException)]
            assert errors == [], errors[:3]
            assert answers == [f"echo: q{k}" for k in range(512)]
            assert len(inference.requests) == 512
            assert elapsed < 60
            await backend.close()


@pytest.mark.vllm
@pytest.mark.train
async def test_local_backend_over_http_survives_sigkill_mid_step(tmp_path: Path, tiny_model: Path) -> None:
    """The real thing: `python -m art_adapters.backend.launch` (LocalBackend, vLLM, trainer) in a subprocess."""
    import psutil

    from art_adapters.demo.tool_choice import SCENARIOS, rollout

    port, root = free_port(), tmp_path / "art"
    command = [sys.executable, "-m", "art_adapters.backend.launch", "--port", str(port), "--path", str(root)]
    command += ["--allow-base-model", str(tiny_model)]
    env = {**os.environ, "ART_ADAPTERS_API_KEY": KEY}

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(command, env=env)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(
                    f"http://127.0.0.1:{port}/health", headers={"authorization": f"Bearer {KEY}"}
                ).is_success:
                    return proc
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError("server did not come up")

    procs = [start()]
    try:
        backend = RemoteBackend(f"http://127.0.0.1:{port}", KEY, timeout_s=900)
        model = art.TrainableModel(
            name="tiny-remote",
            project="p",
            base_model=str(tiny_model),
            lora=art.LoRAConfig(rank=8, alpha=16),
        )
        await model.register(backend)  # starts vLLM on the server (the minutes of this test)
        assert model.inference_base_url == f"http://127.0.0.1:{port}/v1"

        async def varied(request: str, target: str, k: int) -> art.Trajectory:
            # Rewards that differ within each group, so every step has sequences to train: an all-equal group
            # trains nothing and its step finishes before the kill below could land mid-step.
            trajectory = await rollout(model, request, target)
            trajectory.reward = float(k % 2)
            return trajectory

        async def groups() -> list[art.TrajectoryGroup]:
            return await art.gather_trajectory_groups(
                [art.TrajectoryGroup(varied(r, t, k) for k in range(4)) for r, t in SCENARIOS[:2]],
                pbar_desc=None,
            )

        first = await groups()
        call = first[0].trajectories[0].llm_calls[0]
        assert call.completion_token_ids and call.logprobs  # vLLM's token ids came through the proxy
        metrics = await model.train(first, art.TrainConfig(learning_rate=1e-3))
        assert "reward_mean" in metrics and await model.get_step() == 1
        assert metrics["trained_tokens"] > 0, metrics

        model_dir = root / "p/models/tiny-remote"
        steps_before = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
        children = psutil.Process(procs[0].pid).children(recursive=True)
        events: list[dict[str, object]] = []

        async def step_two() -> None:
            async for event in backend.train_events(
                model, await groups(), art.TrainConfig(learning_rate=1e-3)
            ):
                events.append(event)

        task = asyncio.create_task(step_two())
        while not any(e["event"] == "started" for e in events):
            assert not task.done(), task
            await asyncio.sleep(0.01)
        os.kill(procs[0].pid, signal.SIGKILL)
        with pytest.raises(RemoteBackendError, match="connection lost during train of model 'tiny-remote'"):
            await task
        procs[0].wait(10)
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, f"vLLM processes outlived the killed server: {alive}"

        procs.append(start())
        assert await model.get_step() == 1
        listing = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
        assert [name for name in listing if not name.startswith(".")] == steps_before  # a temp dir is hidden
        await model.register(backend)  # a restarted server serves what its clients register again
        assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == steps_before  # and now gone
        answer = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(1), messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert answer.choices
        stream = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert [chunk async for chunk in stream]  # SSE through the proxy
        assert (await model.train(await groups()))["reward_mean"] >= 0 and await model.get_step() == 2
        await backend.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _serve_main(sys.argv[1:])
