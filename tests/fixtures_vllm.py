"""Shared fixtures for tests against one real vLLM server on the cached tiny model (session-scoped).

Register with ``pytest_plugins = ["fixtures_vllm"]``; helpers here are plain functions tests may import.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

import art_adapters as art
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.inference.vllm_server import group_pids
from art_adapters.tiny import tiny_model_path

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_path()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VLLMServer]:
    """One vLLM server for the whole session (~40-100 s start-up on 2 CPU cores)."""
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VLLMServer(tiny_model, InferenceConfig(max_lora_rank=16, max_loras=4), log_path=log_path)
    await server.start()
    print(f"\n[vllm] start-up {server.startup_s:.1f} s, log {log_path}")
    try:
        yield server
    finally:
        pgid = server.process.pid if server.process else None
        await server.stop()
        if pgid is not None:
            assert not group_pids(pgid), f"vLLM processes left after stop(): {group_pids(pgid)}"


async def chat(server: VLLMServer, body: dict[str, Any], *, model: str | None = None) -> dict[str, Any]:
    """POST /v1/chat/completions (non-streaming) and return the JSON body."""
    payload = {"model": model or server.model_name, **body}
    async with httpx.AsyncClient(timeout=120.0) as client:
        r = await client.post(f"{server.base_url}/chat/completions", json=payload, headers=server.headers)
    assert r.status_code == 200, r.text
    return r.json()


async def chat_stream(
    server: VLLMServer, body: dict[str, Any], *, model: str | None = None
) -> list[dict[str, Any]]:
    """POST a streaming chat completion and return the parsed SSE chunks."""
    payload = {"model": model or server.model_name, "stream": True, **body}
    chunks: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(timeout=120.0) as client,
        client.stream(
            "POST", f"{server.base_url}/chat/completions", json=payload, headers=server.headers
        ) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@contextlib.asynccontextmanager
async def registered_on(
    server: VLLMServer, root: Path, *, name: str, project: str
) -> AsyncIterator[tuple[art.LocalBackend, art.TrainableModel]]:
    """A LocalBackend under `root` serving from the shared `server`, with one rank-8 TrainableModel registered."""
    backend = art.LocalBackend(root).use_server(server)
    model = art.TrainableModel(
        name=name, project=project, base_model=str(server.base_model), lora=art.LoRAConfig(rank=8, alpha=16)
    )
    await model.register(backend)
    try:
        yield backend, model
    finally:
        await backend.close()


async def sampled_group(
    model: art.TrainableModel, rewards: list[float], prompt: str = "Say a word", max_tokens: int = 6
) -> art.TrajectoryGroup:
    """One trajectory per reward, each a seeded completion of `prompt` from `model.openai_client()` (Choices carry
    their sampled ids), ART's hand-built way."""
    client = model.openai_client()
    trajectories = []
    for k, reward in enumerate(rewards):
        messages = [{"role": "user", "content": f"{prompt} ({k})."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, seed=k
        )
        trajectories.append(
            art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=reward)
        )
    return art.TrajectoryGroup(trajectories)
