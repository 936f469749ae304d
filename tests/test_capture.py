"""The recording client through the real openai SDK against a real local server: what is recorded, and that the
caller sees exactly what it would see without recording."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket

import httpx
import openai
import pytest

from art_adapters.capture import AsyncRecordingTransport, RecordingTransport, capture, current_trajectory
from art_adapters.recording import async_http_client, async_openai_client, http_client, openai_client
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids
from art_adapters.trajectories import Trajectory

USER = [{"role": "user", "content": "what is 2+2?"}]
TOOLS_REPLY = Reply(
    content="checking",
    tool_calls=[
        {"name": "add", "arguments": {"a": 2, "b": 2}},
        {"name": "lookup", "arguments": {"q": "two plus two"}},
    ],
)


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_sync_json_call_is_recorded_with_vllm_fields() -> None:
    with ScriptedServer([TOOLS_REPLY]) as server:
        client = openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        with capture() as trajectory:
            out = client.chat.completions.create(model="m", messages=USER, temperature=0.7)
    (call,) = trajectory.llm_calls
    assert call.request == {
        "messages": USER,
        "model": "m",
        "temperature": 0.7,
        "return_token_ids": True,
        "logprobs": True,
    }
    assert server.requests == [call.request]
    assert call.url == f"{server.base_url}/chat/completions"
    assert call.status_code == 200 and call.error is None and call.stream is False
    assert call.prompt_token_ids == token_ids(prompt_text(USER, None))
    expected = token_ids(
        'checking<tool_call>add\n{"a": 2, "b": 2}</tool_call><tool_call>lookup\n{"q": "two plus two"}</tool_call><|end|>'
    )
    assert call.completion_token_ids == expected
    assert call.logprobs == [e.logprob for e in out.choices[0].logprobs.content]
    assert len(call.logprobs) == len(expected) and all(lp < 0 for lp in call.logprobs)
    assert call.response["usage"]["completion_tokens"] == len(expected)
    assert call.response["choices"][0]["message"]["tool_calls"][1]["function"]["name"] == "lookup"
    assert 0 < call.latency_s < 5
    assert out.choices[0].message.content == "checking"


async def test_async_stream_reassembles_to_the_non_streamed_body() -> None:
    with ScriptedServer([TOOLS_REPLY], cycle=True) as server:
        client = async_openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        async with capture() as trajectory:
            plain = await client.chat.completions.create(model="m", messages=USER)
            stream = await client.chat.completions.create(
                model="m", messages=USER, stream=True, stream_options={"include_usage": True}
            )
            pieces = [chunk async for chunk in stream]
    json_call, stream_call = trajectory.llm_calls
    assert stream_call.stream is True and stream_call.error is None
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == "checking"
    for key in ("prompt_token_ids", "completion_token_ids", "logprobs"):
        assert getattr(stream_call, key) == getattr(json_call, key), key
    streamed, whole = stream_call.response["choices"][0], json_call.response["choices"][0]
    assert streamed["message"]["content"] == whole["message"]["content"] == "checking"
    assert streamed["message"]["tool_calls"] == whole["message"]["tool_calls"]
    assert streamed["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert streamed["token_ids"] == whole["token_ids"]
    assert streamed["logprobs"]["content"] == whole["logprobs"]["content"]
    assert (
        stream_call.response["usage"]
        == json_call.response["usage"]
        == plain.usage.model_dump(exclude_none=True)
    )


def test_n_greater_than_one_goes_to_other_choices() -> None:
    reply = Reply(content="first", alternatives=[Reply(content="second"), Reply(content="third")])
    with ScriptedServer([reply]) as server:
        client = openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        with capture() as trajectory:
            client.chat.completions.create(model="m", messages=USER, n=3)
    (call,) = trajectory.llm_calls
    assert call.completion_token_ids == token_ids("first<|end|>")
    assert [c.index for c in call.other_choices] == [1, 2]
    assert [c.token_ids for c in call.other_choices] == [
        token_ids("second<|end|>"),
        token_ids("third<|end|>"),
    ]
    assert all(len(c.logprobs) == len(c.token_ids) for c in call.other_choices)
    assert call.other_choices[0].finish_reason == "stop"


def test_explicit_request_fields_are_not_overridden() -> None:
    with ScriptedServer(["ok"], cycle=True) as server:
        client = openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        client.chat.completions.create(
            model="m", messages=USER, logprobs=False, extra_body={"return_token_ids": False}
        )
        client.chat.completions.create(model="m", messages=USER)  # outside a scope: still asks
    assert server.requests[0]["logprobs"] is False and server.requests[0]["return_token_ids"] is False
    assert server.requests[1]["logprobs"] is True and server.requests[1]["return_token_ids"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_caller_gets_exactly_the_server_bytes(stream: bool) -> None:
    reply = Reply(content="exact bytes ✓", tool_calls=[{"name": "f", "arguments": '{ "odd" :1 }'}])
    body = {"model": "m", "messages": USER, "stream": stream, "return_token_ids": True, "logprobs": True}
    with ScriptedServer([reply], cycle=True) as server:
        with httpx.Client() as raw:
            expected = raw.post(f"{server.base_url}/chat/completions", json=body)
        with http_client() as client, capture() as trajectory:
            got = client.post(f"{server.base_url}/chat/completions", json=body)
    created = re.compile(rb'"created": \d+')
    want = created.sub(b"", expected.content.replace(b"chatcmpl-scripted-1", b"chatcmpl-scripted-2"))
    assert created.sub(b"", got.content) == want
    assert b"prompt_token_ids" in got.content
    assert got.headers["content-type"] == expected.headers["content-type"]
    assert len(trajectory.llm_calls) == 1 and trajectory.llm_calls[0].error is None


def test_byte_exact_passthrough_with_a_mock_transport() -> None:
    payload = b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],  "usage":null}'
    mock = httpx.MockTransport(
        lambda request: httpx.Response(200, content=payload, headers={"content-type": "application/json"})
    )
    with httpx.Client(transport=RecordingTransport(mock)) as client, capture() as trajectory:
        got = client.post("http://llm/v1/chat/completions", json={"model": "m", "messages": USER})
    assert got.content == payload
    assert trajectory.llm_calls[0].response["choices"][0]["message"]["content"] == "hi"


def test_gzip_body_is_recorded_decoded_and_passed_through() -> None:
    body = json.dumps(
        {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "zipped"}, "finish_reason": "stop"}
            ]
        }
    )
    compressed = gzip.compress(body.encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    mock = httpx.MockTransport(lambda request: httpx.Response(200, content=compressed, headers=headers))
    with httpx.Client(transport=RecordingTransport(mock)) as client, capture() as trajectory:
        got = client.post("http://llm/v1/chat/completions", json={"model": "m", "messages": USER})
    assert got.json()["choices"][0]["message"]["content"] == "zipped"
    assert trajectory.llm_calls[0].response["choices"][0]["message"]["content"] == "zipped"


def _outcome(fn):  # type: ignore[no-untyped-def]
    try:
        return ("ok", fn())
    except Exception as error:  # noqa: BLE001
        return ("raised", type(error), getattr(error, "status_code", None), str(error))


def test_server_500_is_recorded_and_reaches_the_caller_unchanged() -> None:
    with ScriptedServer([Reply(status=500)], cycle=True) as server:
        raw = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        rec = openai_client(server.base_url, "x", max_retries=0)
        expected = _outcome(lambda: raw.chat.completions.create(model="m", messages=USER))
        with capture() as trajectory:
            got = _outcome(lambda: rec.chat.completions.create(model="m", messages=USER))
    assert got == expected and expected[1] is openai.InternalServerError
    (call,) = trajectory.llm_calls
    assert call.status_code == 500 and call.error.startswith("HTTP 500") and "scripted error" in call.error
    assert call.response is None


def test_retries_are_recorded_one_call_each() -> None:
    with ScriptedServer([Reply(status=500), Reply(content="fine")]) as server:
        client = openai_client(server.base_url, "x", max_retries=1)
        with capture() as trajectory:
            out = client.chat.completions.create(model="m", messages=USER)
    assert out.choices[0].message.content == "fine"
    assert [c.status_code for c in trajectory.llm_calls] == [500, 200]
    assert trajectory.llm_calls[0].error and trajectory.llm_calls[1].error is None


async def test_connection_refused_is_recorded_and_raised_the_same() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    raw = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    rec = async_openai_client(url, "x", max_retries=0)
    with pytest.raises(openai.APIConnectionError) as expected:
        await raw.chat.completions.create(model="m", messages=USER)
    async with capture() as trajectory:
        with pytest.raises(openai.APIConnectionError) as got:
            await rec.chat.completions.create(model="m", messages=USER)
    assert type(got.value) is type(expected.value)
    (call,) = trajectory.llm_calls
    assert call.status_code is None and call.error.startswith("ConnectError")
    assert call.request["messages"] == USER

    transport = AsyncRecordingTransport()
    async with httpx.AsyncClient(transport=transport) as client, capture() as t2:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"{url}/chat/completions", json={"messages": USER})
    assert t2.llm_calls[0].error.startswith("ConnectError")


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_stream_cut_midway_is_recorded_with_what_arrived(mode: str) -> None:
    reply = Reply(content="abcdefghijklmnopqrstuvwxyz" * 4, cut_stream_after=4, chunk_chars=8)
    with ScriptedServer([reply], cycle=True) as server:
        got: list[str] = []
        if mode == "sync":
            client = openai_client(server.base_url, "x", max_retries=0)
            with capture() as trajectory, pytest.raises(openai.APIConnectionError):
                for chunk in client.chat.completions.create(model="m", messages=USER, stream=True):
                    got.append(chunk.choices[0].delta.content or "")
        else:
            aclient = async_openai_client(server.base_url, "x", max_retries=0)
            async with capture() as trajectory:
                with pytest.raises(openai.APIConnectionError):
                    async for chunk in await aclient.chat.completions.create(
                        model="m", messages=USER, stream=True
                    ):
                        got.append(chunk.choices[0].delta.content or "")
    (call,) = trajectory.llm_calls
    assert call.error is not None and "RemoteProtocolError" in call.error
    assert call.response["choices"][0]["message"]["content"] == "".join(got) == "abcdefghijklmnopqrstuvwx"
    assert call.response["choices"][0]["finish_reason"] is None


def test_stream_closed_early_by_the_caller() -> None:
    with ScriptedServer([Reply(content="x" * 400, chunk_chars=4, chunk_delay_s=0.001)]) as server:
        client = openai_client(server.base_url, "x", max_retries=0)
        with capture() as trajectory:
            stream = client.chat.completions.create(model="m", messages=USER, stream=True)
            for i, _ in enumerate(stream):
                if i == 3:
                    break
            stream.close()
    (call,) = trajectory.llm_calls
    assert call.error == "stream closed before [DONE]"
    assert call.response["choices"][0]["message"]["content"].startswith("xxxx")


def test_empty_choices_big_body_and_invalid_json() -> None:
    script = [
        Reply(empty_choices=True),
        Reply(content="z" * 1_000_000, chunk_chars=50_000),
        Reply(raw_body="{oops"),
    ]
    with ScriptedServer(script) as server:
        raw_client = httpx.Client()
        rec = openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        plain = openai_client(server.base_url, "x", max_retries=0)
        with capture() as trajectory:
            assert rec.chat.completions.create(model="m", messages=USER).choices == []
            big = plain.chat.completions.create(model="m", messages=USER, stream=True)
            assert sum(len(c.choices[0].delta.content or "") for c in big if c.choices) == 1_000_000
            with http_client() as client:
                bad = client.post(f"{server.base_url}/chat/completions", json={"messages": USER})
        raw_client.close()
    empty, large, invalid = trajectory.llm_calls
    assert empty.error is None and empty.response["choices"] == [] and empty.completion_token_ids is None
    assert empty.prompt_token_ids == token_ids(prompt_text(USER, None))
    assert large.error is None and len(large.response["choices"][0]["message"]["content"]) == 1_000_000
    assert large.stream and large.completion_token_ids is None
    assert bad.content == b"{oops" and bad.status_code == 200
    assert invalid.error.startswith("invalid JSON") and invalid.response is None


def test_invalid_json_reaches_the_openai_caller_as_without_recording() -> None:
    with ScriptedServer([Reply(raw_body="{oops")], cycle=True) as server:
        raw = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        rec = openai_client(server.base_url, "x", max_retries=0, annotate_choices=True)
        expected = _outcome(lambda: raw.chat.completions.create(model="m", messages=USER))
        with capture() as trajectory:
            got = _outcome(lambda: rec.chat.completions.create(model="m", messages=USER))
    assert got[:2] == expected[:2]
    assert trajectory.llm_calls[0].error.startswith("invalid JSON")


def test_annotate_choices_lets_a_kept_choice_carry_token_ids() -> None:
    with ScriptedServer([TOOLS_REPLY]) as server:
        client = openai_client(
            server.base_url, "x", request_token_ids=True, annotate_choices=True, max_retries=0
        )
        out = client.chat.completions.create(model="m", messages=USER)  # outside a scope: still annotated
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == token_ids(prompt_text(USER, None))
    assert choice.model_extra["token_ids"][-7:] == token_ids("<|end|>")
    trajectory = Trajectory(messages_and_choices=[*USER, choice])
    back = Trajectory.model_validate_json(trajectory.model_dump_json())
    kept = back.messages_and_choices[1]
    assert type(kept) is type(choice)
    assert kept.model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
    assert kept.model_extra["token_ids"] == choice.model_extra["token_ids"]
    assert kept.logprobs.content[0].logprob == choice.logprobs.content[0].logprob


def test_outside_a_scope_nothing_is_recorded_or_wrapped() -> None:
    seen: list[httpx.Response] = []

    def handler(request: httpx.Request) -> httpx.Response:
        response = httpx.Response(200, json={"choices": []})
        seen.append(response)
        return response

    transport = RecordingTransport(httpx.MockTransport(handler))
    request = httpx.Request("POST", "http://llm/v1/chat/completions", json={"messages": USER})
    response = transport.handle_request(request)
    assert response is seen[0] and response.stream is seen[0].stream
    assert current_trajectory() is None
    with ScriptedServer(["a", "b"]) as server:
        client = openai_client(server.base_url, "x", max_retries=0)
        client.chat.completions.create(model="m", messages=USER)
        with capture() as trajectory:
            client.chat.completions.create(model="m", messages=USER)
    assert len(trajectory.llm_calls) == 1
    assert trajectory.llm_calls[0].response["choices"][0]["message"]["content"] == "b"


def test_nested_scopes_inner_wins_and_other_paths_are_ignored() -> None:
    with ScriptedServer(["outer-1", "inner", "outer-2"]) as server:
        client = openai_client(server.base_url, "x", max_retries=0)
        with capture() as outer:
            assert current_trajectory() is outer
            client.chat.completions.create(model="m", messages=USER)
            with capture() as inner:
                assert current_trajectory() is inner
                client.chat.completions.create(model="m", messages=USER)
                client.models.list()
            assert current_trajectory() is outer
            client.chat.completions.create(model="m", messages=USER)
        assert current_trajectory() is None
    contents = lambda t: [c.response["choices"][0]["message"]["content"] for c in t.llm_calls]  # noqa: E731
    assert contents(outer) == ["outer-1", "outer-2"]
    assert contents(inner) == ["inner"]
    assert inner.end_time is not None and outer.end_time is not None


async def test_256_concurrent_captures_never_mix() -> None:
    def responder(request: dict) -> Reply:
        marker = request["messages"][0]["content"]
        return Reply(content=f"{marker}:{len(request['messages'])}", delay_s=0.001 * (int(marker[8:]) % 7))

    with ScriptedServer(responder) as server:
        client = async_openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)

        async def rollout(i: int) -> Trajectory:
            marker = f"rollout-{i}"
            async with capture() as trajectory:
                messages = [{"role": "user", "content": marker}]
                for turn in range(3):
                    if turn == 1:
                        stream = await client.chat.completions.create(
                            model="m", messages=messages, stream=True
                        )
                        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                    else:
                        out = await client.chat.completions.create(model="m", messages=messages)
                        text = out.choices[0].message.content
                    messages = [
                        *messages,
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": "more"},
                    ]
            return trajectory

        trajectories = await asyncio.gather(*[rollout(i) for i in range(256)])
    for i, trajectory in enumerate(trajectories):
        marker = f"rollout-{i}"
        assert len(trajectory.llm_calls) == 3
        for turn, call in enumerate(trajectory.llm_calls):
            assert call.request["messages"][0]["content"] == marker
            assert call.response["choices"][0]["message"]["content"] == f"{marker}:{1 + 2 * turn}"
            assert call.prompt_token_ids == token_ids(prompt_text(call.request["messages"], None))
        assert [m["content"] for m in trajectory.messages()][-1] == f"{marker}:5"


def test_sync_threads_each_with_their_own_scope() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ScriptedServer(lambda r: Reply(content=r["messages"][0]["content"])) as server:
        client = openai_client(server.base_url, "x", max_retries=0)

        def rollout(i: int) -> Trajectory:
            with capture() as trajectory:
                for _ in range(3):
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"t{i}"}])
            return trajectory

        with ThreadPoolExecutor(16) as pool:
            trajectories = list(pool.map(rollout, range(32)))
    for i, trajectory in enumerate(trajectories):
        assert [c.response["choices"][0]["message"]["content"] for c in trajectory.llm_calls] == [f"t{i}"] * 3


async def test_async_http_client_and_completions_endpoint() -> None:
    with ScriptedServer(["text"]) as server:
        async with async_http_client() as client:
            async with capture() as trajectory:
                r = await client.post(
                    f"{server.base_url}/completions",
                    json={"model": "m", "prompt": "ab", "return_token_ids": True},
                )
    assert r.json()["choices"][0]["text"] == "text"
    (call,) = trajectory.llm_calls
    assert call.prompt_token_ids == [97, 98] and call.completion_token_ids == token_ids("text<|end|>")
