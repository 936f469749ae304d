"""ART's capture APIs as ART users write them: `auto_trajectory` / `capture_auto_trajectory` (0.4), `yield_trajectory`,
and ART main's scope (`with art.Trajectory()`, `art.trajectory(...)`, `art.trajectory_group(...)`), each with a plain
`openai.AsyncOpenAI` the rollout builds itself against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.testing import Reply, ScriptedServer

USER = {"role": "user", "content": "Hi!"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "weather",
            "parameters": {"type": "object"},
        },
    }
]


@pytest.fixture
def server():
    with ScriptedServer(Reply(content="Hello! How can I help?"), cycle=True) as srv:
        yield srv


async def test_capture_auto_trajectory_records_calls_of_any_client(server: ScriptedServer) -> None:
    async def say_hi() -> str | None:
        client = AsyncOpenAI(base_url=server.base_url, api_key="default")  # built inside, never wrapped by us
        first = await client.chat.completions.create(model="test", messages=[USER], tools=TOOLS)
        answer = first.choices[0].message.content
        await client.chat.completions.create(
            model="test", messages=[USER, {"role": "assistant", "content": answer}, USER], tools=TOOLS
        )
        await client.chat.completions.create(model="test", messages=[USER])  # another conversation
        if trajectory := art.auto_trajectory():
            trajectory.reward = 1.0
        return answer

    trajectory = await art.capture_auto_trajectory(say_hi())
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 3
    main = (
        trajectory.messages_and_choices
    )  # ART's rule: the conversation the first call opened is the main one
    assert [type(m) for m in main] == [dict, Choice, dict, Choice]
    assert main[1].message.content == "Hello! How can I help?" and trajectory.tools == TOOLS
    assert len(trajectory.additional_histories) == 1
    assert trajectory.metrics["duration"] >= 0
    assert art.auto_trajectory() is None
    with pytest.raises(RuntimeError, match="no trajectory scope"):
        art.auto_trajectory(required=True)


async def test_a_call_offered_other_tools_opens_a_new_history(server: ScriptedServer) -> None:
    """ART's rule, and the right one for training: a call whose tools differ saw a different prompt, so it never
    continues a conversation even when its messages extend it (chained, it would train on a prompt never seen)."""

    async def chat() -> None:
        client = AsyncOpenAI(base_url=server.base_url, api_key="default")
        first = await client.chat.completions.create(model="t", messages=[USER], tools=TOOLS)
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        await client.chat.completions.create(model="t", messages=[USER, answer, USER], tools=TOOLS)
        await client.chat.completions.create(
            model="t", messages=[USER, answer, USER, answer, USER]
        )  # no tools

    trajectory = await art.capture_auto_trajectory(chat())
    assert len(trajectory.messages_and_choices) == 4 and trajectory.tools == TOOLS
    assert len(trajectory.additional_histories) == 1
    other = trajectory.additional_histories[0]
    assert len(other.messages_and_choices) == 6 and other.tools is None


def sse(*chunks: dict[str, object]) -> bytes:
    import json

    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def test_streamed_tool_call_whose_name_repeats_and_no_finish_reason() -> None:
    """Some servers repeat a tool call's whole name in every delta and end a stream without a finish_reason (ART's
    own capture test streams so): the name is kept once, and the answer is a Choice finished by "stop"."""

    def chunk(name: str | None, arguments: str) -> dict[str, object]:
        function = {"name": name, "arguments": arguments}
        delta = {"tool_calls": [{"index": 0, "id": "call-1", "type": "function", "function": function}]}
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "t",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    body = sse(chunk("get_current_weather", "{"), chunk("get_current_weather", ""), chunk(None, "}"))
    reply = Reply(raw_body=body, headers={"content-type": "text/event-stream"})
    with ScriptedServer([reply]) as server:

        async def call() -> None:
            client = AsyncOpenAI(base_url=server.base_url, api_key="k")
            stream = await client.chat.completions.create(
                model="t", messages=[USER], tools=TOOLS, stream=True
            )
            async for _ in stream:
                pass

        trajectory = await art.capture_auto_trajectory(call())
    answer = trajectory.messages_and_choices[-1]
    assert isinstance(answer, Choice) and answer.finish_reason == "stop"
    assert answer.message.tool_calls is not None
    assert answer.message.tool_calls[0].function.name == "get_current_weather"
    assert answer.message.tool_calls[0].function.arguments == "{}"
    assert trajectory.llm_calls[0].response["choices"][0]["finish_reason"] is None  # the record stays true


async def test_stream_without_event_stream_content_type_is_recorded() -> None:
    """A server that streams with a wrong content type: streaming is decided by the request, as openai does."""
    reply = Reply(content="streamed answer", headers={"content-type": "application/octet-stream"})
    with ScriptedServer([reply]) as server:

        async def streamed() -> None:
            client = AsyncOpenAI(base_url=server.base_url, api_key="k")
            async for _ in await client.chat.completions.create(model="m", messages=[USER], stream=True):
                pass

        trajectory = await art.trajectory(streamed())
    (call,) = trajectory.llm_calls
    assert call.error is None and call.stream
    assert call.response["choices"][0]["message"]["content"] == "streamed answer"


async def test_art_main_scope_group_and_current_trajectory(server: ScriptedServer) -> None:
    client = AsyncOpenAI(base_url=server.base_url, api_key="k")

    async def rollout(k: int) -> art.Trajectory:
        with art.Trajectory() as trajectory:
            assert art.current_trajectory(required=True) is trajectory
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{k}"}])
            trajectory.reward = float(k)
        return trajectory

    group = await art.trajectory_group(rollout(k) for k in range(3))
    assert [t.reward for t in group] == [0.0, 1.0, 2.0]
    assert [t.llm_calls[0].request["messages"][0]["content"] for t in group] == ["q0", "q1", "q2"]

    async def failing() -> art.Trajectory:
        raise ValueError("boom")

    group = await art.trajectory_group([rollout(5), failing()], return_exceptions=True)
    assert len(group) == 1 and group.exceptions[0].type == "ValueError"
    with pytest.raises(ValueError, match="boom"):
        await art.trajectory_group([failing()])

    with art.TrajectoryGroup() as collected:
        assert art.current_trajectory_group() is collected
        await rollout(7)
        await rollout(8)
    assert [t.reward for t in collected] == [7.0, 8.0] and art.current_trajectory_group() is None
    with pytest.raises(TypeError, match="coroutine"):
        await art.trajectory(asyncio.sleep)  # type: ignore[arg-type]


async def test_yield_trajectory(server: ScriptedServer) -> None:
    async def rollout() -> None:
        art.yield_trajectory(art.Trajectory(messages_and_choices=[USER], reward=0.5))

    trajectory = await art.capture_yielded_trajectory(rollout())
    assert trajectory.reward == 0.5

    async def silent() -> None:
        return None

    with pytest.raises(RuntimeError, match="yield_trajectory"):
        await art.capture_yielded_trajectory(silent())


async def test_nothing_is_recorded_outside_a_scope(server: ScriptedServer) -> None:
    client = AsyncOpenAI(base_url=server.base_url, api_key="k")
    with art.Trajectory() as inside:
        await client.chat.completions.create(model="m", messages=[USER])
    await client.chat.completions.create(model="m", messages=[USER])
    assert len(inside.llm_calls) == 1 and len(server.requests) == 2


async def test_art_main_scope_records_the_responses_api() -> None:
    """ART main records `client.responses.create`: so do we, in the same scope, JSON and streamed, with a plain
    client the rollout builds itself."""
    with ScriptedServer([Reply(content="first answer"), Reply(content="second answer")]) as server:

        async def rollout() -> None:
            client = AsyncOpenAI(base_url=server.base_url, api_key="k")
            first = await client.responses.create(model="m", input="Hi!", instructions="Be brief.")
            stream = await client.responses.create(
                model="m",
                input=[
                    {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "More?"},
                ],
                instructions="Be brief.",
                stream=True,
            )
            async for _ in stream:
                pass

        trajectory = await art.trajectory(rollout())
    first, second = trajectory.llm_calls
    assert (first.api, first.stream, second.api, second.stream) == ("responses", False, "responses", True)
    assert first.response_message() == {"role": "assistant", "content": "first answer"}
    assert second.error is None and second.response_message() == {
        "role": "assistant",
        "content": "second answer",
    }
    main = trajectory.messages()
    assert main == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "second answer"},
    ]
    assert trajectory.additional_histories == []
