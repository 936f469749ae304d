"""The recording endpoint: agents in another process (a plain OpenAI tool loop in a subprocess), through the
Responses and Anthropic Messages APIs, and a Node agent on npm's official `openai` package against real vLLM,
each recorded into the rollout its URL names, token-exactly, then trained."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.testing import Reply, ScriptedServer

AGENTS = Path(__file__).parent / "agents"
WEATHER = Reply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call_1"}])


def weather_then_answer(request: dict[str, Any]) -> Reply:
    """A tool call for a fresh question, an answer once the tool has spoken."""
    last = (request.get("messages") or [{}])[-1]
    return WEATHER if last.get("role") == "user" else Reply(content="Oslo: 3C and rain.")


async def run_agent(base_url: str, *args: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(AGENTS / "openai_tool_loop.py"),
        base_url,
        "m",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return json.loads(out)


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agent_in_another_process_is_recorded_into_its_rollout(streamed: bool) -> None:
    with (
        ScriptedServer(weather_then_answer) as server,
        RecordingEndpoint(server.base_url, "upstream-key") as endpoint,
    ):
        async with art.capture() as trajectory:
            flags = ["--stream"] if streamed else []
            answer = await run_agent(endpoint.url(), *flags, "--role", "forecaster")
    assert answer == {"answer": "Oslo: 3C and rain."}
    first, second = trajectory.llm_calls
    assert [(c.stream, c.error, c.source.role) for c in (first, second)] == [
        (streamed, None, "forecaster")
    ] * 2
    for call in (first, second):  # the endpoint asked for token ids; the agent never did
        assert call.prompt_token_ids and call.completion_token_ids and call.logprobs
        assert len(call.completion_token_ids) == len(call.logprobs)
    assert all(body.get("return_token_ids") for body in server.requests)
    assert first.response_message()["tool_calls"][0]["function"]["name"] == "get_weather"  # type: ignore[index]
    # the second call continues the first: one conversation, as in-process capture makes it
    assert not trajectory.additional_histories
    assert trajectory.messages()[-1] == {"role": "assistant", "content": "Oslo: 3C and rain."}


async def test_concurrent_rollouts_never_mix_and_a_closed_rollout_is_refused() -> None:
    with ScriptedServer(weather_then_answer) as server, RecordingEndpoint(server.base_url) as endpoint:

        async def rollout(k: int) -> tuple[art.Trajectory, str]:
            async with art.capture() as trajectory:
                url = endpoint.url()
                await asyncio.gather(*(run_agent(url) for _ in range(k)))  # k agents share one rollout
            return trajectory, url

        results = await asyncio.gather(*(rollout(k) for k in (1, 2, 3)))
        for k, (trajectory, _) in zip((1, 2, 3), results, strict=True):
            assert len(trajectory.llm_calls) == 2 * k
            # each agent's calls chain, agents stay apart
            assert len(trajectory.additional_histories) == k - 1
        closed = results[0][1]
        async with httpx.AsyncClient() as client:
            late = await client.post(f"{closed}/chat/completions", json={"model": "m", "messages": []})
            unknown = await client.post(
                f"{endpoint.base_url}/chat/completions",
                json={"model": "m"},
                headers={"x-art-rollout": "guess"},
            )
        assert late.status_code == unknown.status_code == 404
        assert "capture scope ended" in late.json()["error"]["message"]
        assert len(server.requests) == 12  # the refused calls never reached the model


async def test_a_header_names_the_rollout_and_a_dead_upstream_is_a_clear_error() -> None:
    with ScriptedServer(weather_then_answer) as server, RecordingEndpoint(server.base_url) as endpoint:
        async with art.capture() as trajectory:
            import openai

            plain = openai.AsyncOpenAI(
                base_url=endpoint.base_url,
                api_key="x",
                max_retries=0,
                default_headers={"x-art-rollout": endpoint.rollout_id()},
            )
            await plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}])
    assert len(trajectory.llm_calls) == 1 and trajectory.llm_calls[0].completion_token_ids
    with RecordingEndpoint("http://127.0.0.1:9/v1") as endpoint:  # nothing listens on the discard port
        async with art.capture():
            async with httpx.AsyncClient() as client:
                dead = await client.post(
                    f"{endpoint.url()}/chat/completions", json={"model": "m", "messages": []}
                )
    assert dead.status_code == 502 and "did not answer" in dead.json()["error"]["message"]


async def test_responses_and_anthropic_messages_are_recorded_through_the_endpoint() -> None:
    import openai

    anthropic = pytest.importorskip("anthropic")
    with ScriptedServer(cycle=True, script=[Reply(content="Oslo: 3C.")]) as server:
        with RecordingEndpoint(server.base_url) as endpoint:
            async with art.capture() as trajectory:
                url = endpoint.url()
                responses = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
                await responses.responses.create(model="m", input="Weather in Oslo?")
                messages = anthropic.AsyncAnthropic(
                    base_url=url.removesuffix("/v1"), api_key="x", max_retries=0
                )
                async with messages.messages.stream(
                    model="m", max_tokens=32, messages=[{"role": "user", "content": "Weather in Oslo?"}]
                ) as stream:
                    await stream.get_final_message()
    assert [(c.api, c.stream) for c in trajectory.llm_calls] == [("responses", False), ("messages", True)]
    responses_call, messages_call = trajectory.llm_calls
    assert responses_call.prompt_token_ids and responses_call.completion_token_ids
    assert messages_call.completion_token_ids is None  # vLLM's Messages API returns none, in-process alike
    for call in trajectory.llm_calls:
        assert call.response_message() == {"role": "assistant", "content": "Oslo: 3C."}


NODE_AGENT = """
import OpenAI from "openai";
const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "not-the-key", maxRetries: 0 });
const messages = [{ role: "user", content: "Say a word." }];
const first = await client.chat.completions.create({ model, messages, max_tokens: 8, seed: 1 });
messages.push({ role: "assistant", content: first.choices[0].message.content });
messages.push({ role: "user", content: "And another." });
const stream = await client.chat.completions.create({ model, messages, max_tokens: 8, seed: 2, stream: true });
let second = "";
for await (const chunk of stream) second += chunk.choices[0]?.delta?.content ?? "";
console.log(JSON.stringify({ first: first.choices[0].message.content, second }));
"""


def node_openai() -> Path:
    """npm's official `openai` package, installed once into the user's cache."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js is not installed")
    root = Path.home() / ".cache" / "art-adapters" / "node-openai"
    if not (root / "node_modules" / "openai" / "package.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund", "--silent", "openai@7"],
            check=True,
            timeout=300,
        )
    return root


@pytest.mark.timeout(600)
async def test_a_node_agent_on_vllm_is_recorded_token_exactly_and_trains(
    tmp_path: Path, vllm_server: Any
) -> None:
    from fixtures_vllm import registered_on

    root = node_openai()
    script = root / "agent.mjs"
    script.write_text(NODE_AGENT)
    async with registered_on(vllm_server, tmp_path, name="node", project="endpoint") as (backend, model):
        assert model.inference_api_key, "the model's endpoint is behind a key the Node agent never sees"
        with RecordingEndpoint(model.inference_base_url, model.inference_api_key) as endpoint:

            async def rollout(reward: float) -> art.Trajectory:
                async with art.capture() as trajectory:
                    process = await asyncio.create_subprocess_exec(
                        "node",
                        str(script),
                        endpoint.url(),
                        model.get_inference_name(),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                    )
                    out, err = await process.communicate()
                    assert process.returncode == 0, err.decode()
                trajectory.reward = reward
                trajectory.metadata["said"] = json.loads(out)
                return trajectory

            trajectories = await asyncio.gather(*(rollout(r) for r in (1.0, 0.0, 0.5)))
        for trajectory in trajectories:
            first, second = trajectory.llm_calls
            assert (first.stream, second.stream) == (False, True)
            assert first.response_message()["content"] == trajectory.metadata["said"]["first"]  # type: ignore[index]
            assert len(second.completion_token_ids or []) == len(second.logprobs or []) > 0
            assert not trajectory.additional_histories  # the streamed turn continues the first
        result = await backend.train(model, [art.TrajectoryGroup(trajectories)])
    assert result.metrics["sampled_token_fraction"] == 1.0
    assert result.step == 1
