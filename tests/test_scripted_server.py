"""ScriptedServer speaks the OpenAI wire format (JSON + SSE, vLLM token fields) and injects faults on request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["uvicorn", "stdlib"])
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


def test_json_reply_with_vllm_fields(engine: str) -> None:
    reply = Reply(content="hello", tool_calls=[{"name": "f", "arguments": {"x": 1}}])
    with ScriptedServer([reply], engine=engine) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model="m", messages=USER, logprobs=True, extra_body={"return_token_ids": True}
        )
    assert server.requests == [{"model": "m", "messages": USER, "logprobs": True, "return_token_ids": True}]
    choice = out.choices[0]
    assert choice.message.content == "hello"
    assert choice.message.tool_calls[0].function.name == "f"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"x": 1}
    assert choice.finish_reason == "tool_calls"
    expected = token_ids('hello<tool_call>f\n{"x": 1}</tool_call><|end|>')
    assert choice.model_extra["token_ids"] == expected
    assert out.model_extra["prompt_token_ids"] == token_ids(prompt_text(USER, None))
    assert len(choice.logprobs.content) == len(expected)
    assert all(entry.logprob < 0 for entry in choice.logprobs.content)
    assert out.usage.completion_tokens == len(expected)


def test_no_token_fields_unless_asked() -> None:
    with ScriptedServer(["plain"]) as server:
        body = httpx.post(f"{server.base_url}/chat/completions", json={"model": "m", "messages": USER}).json()
    assert "prompt_token_ids" not in body
    assert "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None
    assert body["object"] == "chat.completion"


def test_stream_with_usage_and_token_ids(engine: str) -> None:
    reply = Reply(
        content="streamed text!",
        tool_calls=[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": "raw"}],
    )
    with ScriptedServer([reply], engine=engine) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="m",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == token_ids(prompt_text(USER, None))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "streamed text!"
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == token_ids(
        'streamed text!<tool_call>a\n{"q": 1}</tool_call><tool_call>b\nraw</tool_call><|end|>'
    )
    args: dict[int, str] = {}
    for c in chunks:
        for call in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
    assert args == {0: '{"q": 1}', 1: "raw"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_n_choices_and_alternatives() -> None:
    with ScriptedServer([Reply(content="a", alternatives=[Reply(content="b")])]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        out = client.chat.completions.create(model="m", messages=USER, n=3)
    assert [c.message.content for c in out.choices] == ["a", "b", "b"]
    assert [c.index for c in out.choices] == [0, 1, 2]


def test_faults(engine: str) -> None:
    script = [
        Reply(status=500),
        Reply(raw_body="{not json"),
        Reply(content="x" * 100, cut_stream_after=3),
        Reply(empty_choices=True),
        Reply(content="y" * 1_000_000, chunk_chars=65536),
    ]
    with ScriptedServer(script, engine=engine) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="m", messages=USER)
        assert info.value.status_code == 500 and "scripted error" in info.value.message
        raw = httpx.post(f"{server.base_url}/chat/completions", json={"messages": USER})
        assert raw.status_code == 200 and raw.content == b"{not json"
        with pytest.raises(openai.APIConnectionError):
            for _ in client.chat.completions.create(model="m", messages=USER, stream=True):
                pass
        assert client.chat.completions.create(model="m", messages=USER).choices == []
        big = client.chat.completions.create(model="m", messages=USER)
        assert len(big.choices[0].message.content) == 1_000_000
        with pytest.raises(openai.InternalServerError, match="500"):  # the script is spent
            client.chat.completions.create(model="m", messages=USER)


def test_models_and_cycle_and_echo() -> None:
    with ScriptedServer(["one", "two"], cycle=True, model="tiny") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        answers = [
            client.chat.completions.create(model="m", messages=USER).choices[0].message.content
            for _ in range(5)
        ]
    assert answers == ["one", "two", "one", "two", "one"]
    with ScriptedServer() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        out = client.chat.completions.create(model="m", messages=USER)
    assert out.choices[0].message.content == "echo: hi"


def test_responder_and_delay() -> None:
    def responder(request: dict) -> Reply:
        return Reply(content=request["messages"][-1]["content"].upper(), delay_s=0.2)

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        outs = await asyncio.gather(
            *[
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"m{i}"}])
                for i in range(50)
            ]
        )
        return [o.choices[0].message.content for o in outs]

    with ScriptedServer(responder) as server:
        start = time.perf_counter()
        answers = asyncio.run(main())
        elapsed = time.perf_counter() - start
    assert answers == [f"M{i}" for i in range(50)]
    assert elapsed < 3.0  # delays overlap: concurrent, not serialised


def test_sequential_and_concurrent_throughput() -> None:
    with ScriptedServer(cycle=True) as server:
        with httpx.Client() as client:
            start = time.perf_counter()
            for i in range(2000):
                r = client.post(
                    f"{server.base_url}/chat/completions",
                    json={"messages": [{"role": "user", "content": str(i)}]},
                )
                assert r.status_code == 200
            sequential = time.perf_counter() - start

        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=1024)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                rs = await asyncio.gather(
                    *[
                        client.post(f"{server.base_url}/chat/completions", json={"messages": USER})
                        for _ in range(512)
                    ]
                )
                return [r.status_code for r in rs]

        start = time.perf_counter()
        codes = asyncio.run(burst())
        concurrent = time.perf_counter() - start
    assert codes == [200] * 512
    assert len(server.requests) == 2512
    assert sequential < 30 and concurrent < 30, (sequential, concurrent)


def test_completions_endpoint() -> None:
    with ScriptedServer(["done"]) as server:
        body = httpx.post(
            f"{server.base_url}/completions", json={"model": "m", "prompt": "ab", "return_token_ids": True}
        ).json()
    assert body["choices"][0]["text"] == "done"
    assert body["choices"][0]["prompt_token_ids"] == [97, 98]
    assert body["choices"][0]["token_ids"] == token_ids("done<|end|>")
