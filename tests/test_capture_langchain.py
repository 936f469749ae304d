"""LangChain's ChatOpenAI records through `http_client=` / `http_async_client=`: invoke, ainvoke, astream, tools."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain_openai")

from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

from art_adapters.capture import capture  # noqa: E402
from art_adapters.recording import async_http_client, http_client  # noqa: E402
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids  # noqa: E402


def chat(server: ScriptedServer, **kw: object) -> ChatOpenAI:
    return ChatOpenAI(
        model="m",
        base_url=server.base_url,
        api_key="x",
        max_retries=0,
        http_client=http_client(request_token_ids=True),
        http_async_client=async_http_client(request_token_ids=True),
        **kw,
    )


def test_invoke_with_parallel_tool_calls_then_answer() -> None:
    script = [
        Reply(
            tool_calls=[
                {"name": "add", "arguments": {"a": 1, "b": 2}},
                {"name": "mul", "arguments": {"a": 3, "b": 4}},
            ]
        ),
        Reply(content="3 and 12"),
    ]
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}},
    ]
    with ScriptedServer(script) as server:
        llm = chat(server).bind_tools(tools)
        with capture() as trajectory:
            messages = [HumanMessage("compute")]
            first = llm.invoke(messages)
            assert [c["name"] for c in first.tool_calls] == ["add", "mul"]
            messages += [first] + [ToolMessage(content="r", tool_call_id=c["id"]) for c in first.tool_calls]
            final = llm.invoke(messages)
    assert final.content == "3 and 12"
    one, two = trajectory.llm_calls
    assert one.request["tools"] == tools and one.request["return_token_ids"] is True
    assert [c["function"]["name"] for c in one.response["choices"][0]["message"]["tool_calls"]] == [
        "add",
        "mul",
    ]
    assert one.prompt_token_ids == token_ids(prompt_text(one.request["messages"], tools))
    assert two.prompt_token_ids[: len(one.prompt_token_ids) + len(one.completion_token_ids)] == (
        one.prompt_token_ids + one.completion_token_ids
    )
    assert len(two.logprobs) == len(two.completion_token_ids) == len("3 and 12<|end|>")
    # LangChain re-serialises arguments; the conversation still chains into one history
    assert trajectory.additional_histories == []
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "tool", "assistant"]
    assert json.loads(trajectory.messages()[1]["tool_calls"][1]["function"]["arguments"]) == {"a": 3, "b": 4}


async def test_ainvoke_and_astream() -> None:
    with ScriptedServer(["async answer", Reply(content="streamed answer", chunk_chars=3)]) as server:
        llm = chat(server, stream_usage=True)
        async with capture() as trajectory:
            answer = await llm.ainvoke([HumanMessage("q1")])
            pieces = [chunk async for chunk in llm.astream([HumanMessage("q2")])]
    assert answer.content == "async answer"
    assert "".join(p.content for p in pieces) == "streamed answer"
    one, two = trajectory.llm_calls
    assert one.stream is False and two.stream is True and two.error is None
    assert two.response["choices"][0]["message"]["content"] == "streamed answer"
    assert two.completion_token_ids == token_ids("streamed answer<|end|>")
    assert two.response["usage"]["completion_tokens"] == len(two.completion_token_ids)
    assert two.prompt_token_ids == token_ids(prompt_text([{"role": "user", "content": "q2"}], None))
    assert len(trajectory.additional_histories) == 1  # two unrelated conversations


def test_stream_sync_and_error_reaches_langchain() -> None:
    with ScriptedServer([Reply(content="abc"), Reply(status=500)]) as server:
        llm = chat(server)
        with capture() as trajectory:
            assert "".join(c.content for c in llm.stream([HumanMessage("x")])) == "abc"
            with pytest.raises(Exception) as info:
                llm.invoke([HumanMessage("y")])
    assert "500" in str(info.value)
    assert [c.status_code for c in trajectory.llm_calls] == [200, 500]
    assert trajectory.llm_calls[1].error.startswith("HTTP 500")


async def test_a_stream_abandoned_mid_way_does_not_lend_its_source_to_later_calls() -> None:
    """The model run's source is pending in the task from its start to its end. A stream left after its first
    chunk ends when the generator is closed (in another task); a plain client's call after it is not LangChain's."""
    import asyncio

    import openai

    with ScriptedServer(lambda request: Reply(content="a long streamed answer")) as server:
        llm = chat(server, streaming=True)
        raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", http_client=async_http_client())
        async with capture() as trajectory:
            async for _ in llm.astream("hi"):
                break
            await asyncio.sleep(0)  # the event loop closes the abandoned generator
            await raw.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            await llm.ainvoke("again")
    streamed, plain, again = trajectory.llm_calls
    assert streamed.source.framework == "langchain" and streamed.source.run_id
    assert plain.source.framework == "openai" and plain.source.run_id is None
    assert again.source.framework == "langchain" and again.source.run_id not in (None, streamed.source.run_id)
