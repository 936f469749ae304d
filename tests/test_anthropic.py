"""Anthropic's Messages API (`/v1/messages`) through the same capture: the real `anthropic` SDK against the
scripted server (JSON, streamed, tool use, a cut stream, an HTTP error), the chat view of requests and answers,
and the adapters' decorator recording it on the model's endpoint."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.apis.anthropic import chat_choice, chat_messages, chat_tools, final_message
from art_adapters.openai import wrap_rollout
from art_adapters.testing import Reply, ScriptedServer

anthropic = pytest.importorskip("anthropic")

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
STREAM_ERRORS: tuple[type[BaseException], ...] = (anthropic.APIError, httpx.TransportError)
try:  # anthropic's client on httpx2 raises its transport errors as they come
    import httpx2

    STREAM_ERRORS += (httpx2.TransportError,)
except ImportError:  # pragma: no cover
    pass
WEATHER = Reply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "toolu_1"}])


def client_of(server: ScriptedServer) -> Any:
    return anthropic.AsyncAnthropic(base_url=server.base_url.removesuffix("/v1"), api_key="k", max_retries=0)


async def tool_loop(client: Any, streamed: bool) -> str:
    """A plain Anthropic tool loop, as its users write it."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    while True:
        kwargs = {"model": "m", "max_tokens": 64, "system": "Be brief.", "messages": history, "tools": TOOLS}
        if streamed:
            async with client.messages.stream(**kwargs) as stream:
                answer = await stream.get_final_message()
        else:
            answer = await client.messages.create(**kwargs)
        history.append({"role": "assistant", "content": [block.model_dump() for block in answer.content]})
        uses = [block for block in answer.content if block.type == "tool_use"]
        if not uses:
            return "".join(block.text for block in answer.content if block.type == "text")
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "3C, rain"} for u in uses]
        history.append({"role": "user", "content": results})


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_tool_loop_is_recorded_as_one_conversation(streamed: bool) -> None:
    with ScriptedServer([WEATHER, Reply(content="Oslo: 3C and rain.")]) as server:
        trajectory = await art.trajectory(tool_loop(client_of(server), streamed))
    first, second = trajectory.llm_calls
    assert [(c.api, c.stream, c.error) for c in (first, second)] == [("messages", streamed, None)] * 2
    assert first.response_message() == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert first.choices()[0]["finish_reason"] == "tool_calls"
    assert second.choices()[0]["finish_reason"] == "stop"
    assert trajectory.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": first.response_message()["tool_calls"]},  # type: ignore[index]
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3C, rain"},
        {"role": "assistant", "content": "Oslo: 3C and rain."},
    ]
    assert trajectory.additional_histories == []
    assert trajectory.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    assert first.prompt_token_ids is None and first.completion_token_ids is None  # this API gives none


async def test_the_decorator_records_anthropic_calls_on_the_models_endpoint() -> None:
    with ScriptedServer([WEATHER, Reply(content="Rainy.")]) as server:
        model = art.Model(name="m", project="p", inference_base_url=server.base_url, inference_api_key="k")

        @wrap_rollout(model)
        async def rollout() -> float:
            await tool_loop(client_of(server), streamed=True)
            return 1.0

        trajectory = await rollout()
    assert trajectory.reward == 1.0 and [c.api for c in trajectory.llm_calls] == ["messages", "messages"]
    assert trajectory.messages()[-1] == {"role": "assistant", "content": "Rainy."}


async def test_a_cut_stream_and_an_http_error_are_recorded_as_errors() -> None:
    script = [Reply(content="never finished", cut_stream_after=3), Reply(status=529, content="overloaded")]
    with ScriptedServer(script) as server:
        client = client_of(server)

        async def rollout() -> None:
            with pytest.raises(STREAM_ERRORS):
                async with client.messages.stream(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                ) as stream:
                    await stream.get_final_message()
            with pytest.raises(anthropic.APIStatusError):
                await client.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )

        trajectory = await art.trajectory(rollout())
    cut, failed = trajectory.llm_calls
    assert cut.stream and cut.error and "RemoteProtocolError" in cut.error
    assert failed.error and failed.error.startswith("HTTP 529")
    assert trajectory.messages() == []  # nothing answered: no conversation


def test_chat_view_of_blocks_thinking_and_tool_results() -> None:
    request = {
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "5"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "", "is_error": True},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        "tools": [
            {"name": "add", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "w"},
        ],
    }
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "Adding.",
            "reasoning": "Use the tool.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "5"},
        {"role": "tool", "tool_call_id": "t2", "content": "error"},
        {"role": "user", "content": "Thanks."},
    ]
    assert chat_tools(request["tools"]) == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
        {"type": "web_search_20250305", "name": "w"},  # the server's own tool, as it is
    ]
    truncated = {"content": [{"type": "text", "text": "Add"}], "stop_reason": "max_tokens"}
    assert chat_choice(truncated) == {
        "index": 0,
        "message": {"role": "assistant", "content": "Add"},
        "finish_reason": "length",
    }


def test_stream_events_build_the_message() -> None:
    events = [
        {
            "type": "message_start",
            "message": {"id": "m1", "role": "assistant", "content": [], "usage": {"input_tokens": 5}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hm"}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"x"'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ": 1}"},
        },
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 7}},
    ]
    message, done = final_message(events)
    assert not done  # no message_stop yet
    assert message == {
        "id": "m1",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Hm"},
            {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}},
        ],
        "usage": {"input_tokens": 5, "output_tokens": 7},
        "stop_reason": "tool_use",
    }
    assert final_message([*events, {"type": "message_stop"}])[1] is True
    assert final_message([]) == (None, False)


def test_tracing_reads_the_usage_of_every_api() -> None:
    """Langfuse's usage details: chat's prompt/completion tokens, Responses' and Messages' input/output tokens."""
    from art_adapters.tracing._convert import usage_of
    from art_adapters.trajectories import LLMCall

    chat = LLMCall(
        request={}, response={"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    )
    messages = LLMCall(
        request={}, url="http://h/v1/messages", response={"usage": {"input_tokens": 7, "output_tokens": 4}}
    )
    assert usage_of(chat) == {"input": 3, "output": 2, "total": 5}
    assert usage_of(messages) == {"input": 7, "output": 4, "total": 11}
