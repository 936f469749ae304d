"""The Agents SDK adapter: `Runner.run` on an `OpenAIChatCompletionsModel` captured through the scoped hook."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytest.importorskip("agents")

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.openai_agents import chat_completions_model, wrap_rollout  # noqa: E402
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids  # noqa: E402

set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


def model_for(server: ScriptedServer) -> art.Model:
    return art.Model(name="agent", inference_base_url=server.base_url, inference_api_key="x")


def agent_on(server: ScriptedServer) -> Agent:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    model = OpenAIChatCompletionsModel(model="agent", openai_client=client)
    return Agent(name="calc", instructions="You add numbers.", tools=[add, fail], model=model)


async def test_runner_run_is_captured_in_order_with_token_ids() -> None:
    script = [
        Reply(
            tool_calls=[
                {"name": "add", "arguments": {"a": 2, "b": 3}, "id": "c1"},
                {"name": "fail", "arguments": {"reason": "no"}, "id": "c2"},
            ]
        ),
        Reply(tool_calls=[{"name": "add", "arguments": '{"a": 2', "id": "c3"}]),  # malformed JSON
        Reply(content="5"),
    ]
    with ScriptedServer(script) as server:
        agent = agent_on(server)  # built outside the decorated call

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout(question: str) -> float:
            result = await Runner.run(agent, question)
            return 1.0 if result.final_output == "5" else 0.0

        trajectory = await rollout("2 + 3?")
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 3
    messages = trajectory.messages()
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[3]["content"] == "5" and "error" in messages[4]["content"]
    for call in trajectory.llm_calls:
        assert call.prompt_token_ids == token_ids(
            prompt_text(call.request["messages"], call.request.get("tools"))
        )
        assert call.completion_token_ids
    assert not trajectory.additional_histories


async def test_concurrent_runs_and_undecorated_runs_do_not_mix() -> None:
    def responder(request: dict) -> Reply:
        question = request["messages"][1]["content"]
        if request["messages"][-1]["role"] == "tool":
            return Reply(content=f"answer to {question}")
        return Reply(tool_calls=[{"name": "add", "arguments": {"a": len(question), "b": 0}}])

    with ScriptedServer(responder) as server:
        agent = agent_on(server)

        @wrap_rollout(model_for(server))
        async def rollout(question: str) -> float:
            result = await Runner.run(agent, question)
            return 1.0 if result.final_output == f"answer to {question}" else 0.0

        questions = [f"q{i}" for i in range(8)]
        results = await asyncio.gather(
            *(rollout(q) for q in questions), *(Runner.run(agent, f"p{i}") for i in range(4))
        )
    for question, trajectory in zip(questions, results[:8], strict=True):
        assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 2
        assert all(c.request["messages"][1]["content"] == question for c in trajectory.llm_calls)
    assert len(server.requests) == 24


async def test_chat_completions_model_records_inside_capture() -> None:
    from art_adapters.capture import capture

    with ScriptedServer([Reply(content="hello"), Reply(content="again")]) as server:
        model = model_for(server)
        agent = Agent(name="greeter", instructions="Greet.", model=chat_completions_model(model))
        async with capture() as trajectory:
            await Runner.run(agent, "hi")
        await Runner.run(agent, "not recorded")
    assert len(trajectory.llm_calls) == 1 and trajectory.messages()[-1]["content"] == "hello"
