"""The plain-OpenAI adapter: tool loops on clients the rollout builds itself, malformed tool calls as tool errors."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

import art_adapters as art
from art_adapters.adapters.base import hook_installed
from art_adapters.envs import SQLiteEnv
from art_adapters.openai import run_tool_loop, wrap_rollout
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "explode", "description": "Always fails.", "parameters": {"type": "object"}},
    },
]


def lookup(word: str) -> str:
    return {"sun": "a star"}.get(word, "unknown word")


async def explode() -> str:
    raise RuntimeError("kaboom")


FUNCTIONS = {"lookup": lookup, "explode": explode}

MALFORMED = [
    Reply(tool_calls=[{"name": "lookup", "arguments": '{"word": "sun"'}]),  # bad JSON
    Reply(tool_calls=[{"name": "search_web", "arguments": {"q": "sun"}}]),  # unknown tool
    Reply(tool_calls=[{"name": "lookup", "arguments": {"term": "sun"}}]),  # wrong arguments
    Reply(tool_calls=[{"name": "explode", "arguments": {}}]),  # a tool that raises
    Reply(tool_calls=[{"name": "lookup", "arguments": "[1, 2]"}]),  # not an object
    Reply(tool_calls=[{"name": "lookup", "arguments": {"word": "sun"}}]),
    Reply(content="The sun is a star."),
]


def model_for(server: ScriptedServer) -> art.Model:
    return art.Model(name="agent", inference_base_url=server.base_url, inference_api_key="x")


def assert_token_ids(trajectory: art.Trajectory) -> None:
    for call in trajectory.llm_calls:
        assert call.prompt_token_ids == token_ids(
            prompt_text(call.request["messages"], call.request.get("tools"))
        )
        assert call.completion_token_ids


async def test_malformed_tool_calls_become_recorded_tool_errors() -> None:
    with ScriptedServer(MALFORMED) as server:

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout() -> float:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "What is the sun?"}]
            result = await run_tool_loop(client, "agent", messages, TOOLS, FUNCTIONS, max_turns=10)
            assert result.turns == 7 and result.tool_calls == 6 and result.tool_errors == 5
            return 1.0 if result.final == "The sun is a star." else 0.0

        trajectory = await rollout()
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 7
    tool_messages = [m["content"] for m in trajectory.messages() if m["role"] == "tool"]
    assert tool_messages[0].startswith("Error: arguments are not valid JSON")
    assert tool_messages[1].startswith("Error: unknown tool 'search_web'")
    assert tool_messages[2].startswith("Error: wrong arguments for lookup")
    assert tool_messages[3] == "Error: explode raised RuntimeError: kaboom"
    assert tool_messages[4].startswith("Error: arguments must be a JSON object")
    assert tool_messages[5] == "a star"
    for k, call in enumerate(trajectory.llm_calls[1:]):  # each call sees the previous tool result
        assert call.request["messages"][-1]["content"] == tool_messages[k]
    assert not trajectory.additional_histories
    assert_token_ids(trajectory)


async def test_parallel_tool_calls_and_max_turns() -> None:
    two = Reply(
        tool_calls=[
            {"name": "lookup", "arguments": {"word": "sun"}},
            {"name": "lookup", "arguments": {"word": "x"}},
        ]
    )
    with ScriptedServer([two, two, two]) as server:

        @wrap_rollout(model_for(server))
        async def rollout() -> art.Trajectory:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            result = await run_tool_loop(
                client,
                art.Model(name="agent"),
                [{"role": "user", "content": "?"}],
                TOOLS,
                [lookup, explode],
                max_turns=2,
            )
            assert result.final is None and result.turns == 2 and result.tool_calls == 4
            return art.Trajectory(reward=0.25)

        trajectory = await rollout()
    assert trajectory.reward == 0.25 and len(trajectory.llm_calls) == 2
    messages = trajectory.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in messages[2:4]] == ["a star", "unknown word"]


async def test_sync_client_in_an_async_rollout() -> None:
    with ScriptedServer(MALFORMED[-2:]) as server:

        @wrap_rollout(model_for(server))
        async def rollout() -> float:
            client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            result = await run_tool_loop(
                client, "agent", [{"role": "user", "content": "sun?"}], TOOLS, FUNCTIONS
            )
            return float(result.turns)

        trajectory = await rollout()
    assert trajectory.reward == 2.0 and len(trajectory.llm_calls) == 2


def test_sync_rollout_with_a_hand_written_loop() -> None:
    with ScriptedServer(MALFORMED[-2:]) as server:

        @wrap_rollout(model_for(server), request_token_ids=True)
        def rollout() -> float:
            client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "sun?"}]
            while True:
                message = (
                    client.chat.completions.create(model="agent", messages=messages, tools=TOOLS)
                    .choices[0]
                    .message
                )
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return 1.0
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup("sun")})

        trajectory = rollout()
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 2
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    assert_token_ids(trajectory)
    assert not hook_installed()


async def test_model_openai_client_is_recorded_once_and_outside_calls_not_at_all() -> None:
    with ScriptedServer(lambda request: Reply(content="hi")) as server:
        model = model_for(server)
        outside_client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)

        @wrap_rollout(model)
        async def rollout(k: int) -> float:
            client = model.openai_client()  # already a recording client: the hook leaves it alone
            await client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"r{k}"}]
            )
            await outside_client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"o{k}"}]
            )
            return 1.0

        async def undecorated(k: int) -> None:
            await outside_client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"u{k}"}]
            )
            await model.openai_client().chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"v{k}"}]
            )

        results = await asyncio.gather(*(rollout(k) for k in range(8)), *(undecorated(k) for k in range(8)))
    for k, trajectory in enumerate(results[:8]):
        assert [c.request["messages"][0]["content"] for c in trajectory.llm_calls] == [f"r{k}", f"o{k}"]
    assert len(server.requests) == 32


async def test_sqlite_env_tools_in_a_tool_loop(tmp_path: Any) -> None:
    env = SQLiteEnv(tmp_path / "shop.sqlite")
    scenario = next(s for s in env.scenarios() if s.question.startswith("How many customers live in"))
    script = [
        Reply(tool_calls=[{"name": "run_query", "arguments": {"sql": "DROP TABLE customers"}}]),
        Reply(
            tool_calls=[
                {"name": "run_query", "arguments": {"sql": scenario.metadata["sql"].replace("?", "'Lisbon'")}}
            ]
        ),
        Reply(content=f"ANSWER: {scenario.answer}"),
    ]
    with ScriptedServer(script) as server:

        @wrap_rollout(model_for(server))
        async def rollout() -> float:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            messages = [
                {"role": "system", "content": env.system_prompt()},
                {"role": "user", "content": scenario.question},
            ]
            result = await run_tool_loop(client, "agent", messages, functions=env.tools())
            return env.reward(scenario, result.final)

        trajectory = await rollout()
    assert trajectory.reward == 1.0
    tool_messages = [m["content"] for m in trajectory.messages() if m["role"] == "tool"]
    assert tool_messages[0] == "Error: not authorized" and tool_messages[1].splitlines()[1] == str(
        scenario.answer
    )
    assert trajectory.llm_calls[0].request["tools"] == env.tools().schemas


async def test_plain_httpx_clients_the_agent_passes_are_recorded_too() -> None:
    import httpx

    with ScriptedServer(lambda request: Reply(content="hi")) as server:
        async_client = openai.AsyncOpenAI(
            base_url=server.base_url, api_key="x", http_client=httpx.AsyncClient()
        )
        sync_client = openai.OpenAI(base_url=server.base_url, api_key="x", http_client=httpx.Client())

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout() -> float:
            await async_client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "a"}]
            )
            stream = await async_client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "b"}], stream=True
            )
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            await asyncio.to_thread(
                sync_client.chat.completions.create,
                model="agent",
                messages=[{"role": "user", "content": "c"}],
            )
            return 1.0 if text == "hi" else 0.0

        trajectory = await rollout()
        await async_client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "d"}])
    assert trajectory.reward == 1.0
    assert [c.request["messages"][0]["content"] for c in trajectory.llm_calls] == ["a", "b", "c"]
    assert [c.stream for c in trajectory.llm_calls] == [False, True, False]
    assert_token_ids(trajectory)
    assert len(server.requests) == 4


def test_decorator_forms_and_bad_results() -> None:
    with pytest.raises(TypeError, match="float reward"):
        wrap_rollout(None, lambda: "yes")()
    assert wrap_rollout(None, lambda: None)().reward == 0.0
    assert wrap_rollout(None)(lambda: 2)().reward == 2.0
