"""Capture where it used to lose or misfile calls: raw U+2028 in streamed JSON, cancelled requests, calls that end
after their scope closed, and an httpx whose private lookup is gone."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import art_adapters as art
from art_adapters.adapters import base
from art_adapters.capture import capture
from art_adapters.recording import async_openai_client
from art_adapters.testing import Reply, ScriptedServer

USER = [{"role": "user", "content": "hi"}]


def sse(*texts: str) -> bytes:
    """A chat stream whose JSON carries the texts raw (ensure_ascii off: U+2028 and U+0085 unescaped)."""
    events = [
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": t}}],
        }
        for t in texts
    ]
    events.append(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
    )
    body = (
        "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\r\n\r\n"
    )
    return body.encode()


async def test_streamed_json_with_raw_line_separators_is_recorded_whole() -> None:
    text = ["line\u2028sep", " para\u2029sep", " next\u0085line", " vt\x0bff\x0c"]
    reply = Reply(raw_body=sse(*text), headers={"content-type": "text/event-stream"})
    with ScriptedServer([reply]) as server:
        client = async_openai_client(server.base_url, "k", max_retries=0)
        async with capture() as trajectory:
            stream = await client.chat.completions.create(model="m", messages=USER, stream=True)
            received = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    (call,) = trajectory.llm_calls
    assert received == "".join(text)
    assert call.error is None and call.response["choices"][0]["message"]["content"] == "".join(text)


async def test_a_cancelled_request_still_finishes_its_record() -> None:
    with ScriptedServer([Reply(content="slow", delay_s=5)]) as server:
        client = async_openai_client(server.base_url, "k", max_retries=0)
        async with capture() as trajectory:
            task = asyncio.ensure_future(client.chat.completions.create(model="m", messages=USER))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    (call,) = trajectory.llm_calls
    assert call.error is not None and "Cancelled" in call.error


async def test_a_call_that_ends_after_its_scope_closed_is_not_added(caplog: pytest.LogCaptureFixture) -> None:
    with ScriptedServer([Reply(content="late", delay_s=0.5)]) as server:
        client = async_openai_client(server.base_url, "k", max_retries=0)
        async with capture() as trajectory:
            task = asyncio.ensure_future(client.chat.completions.create(model="m", messages=USER))
            await asyncio.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger="art_adapters.capture.record"):
            completion = await task  # the caller still gets its answer
    assert completion.choices[0].message.content == "late"
    assert trajectory.llm_calls == [] and "ended after its capture scope closed" in caplog.text


async def test_the_hook_fails_soft_when_httpx_has_no_lookup_to_wrap(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class RenamedClient:  # an httpx whose private per-URL lookup was renamed
        pass

    monkeypatch.setattr(base, "_targets", lambda: [(RenamedClient, True, False)])
    monkeypatch.setattr(base, "_warned", set())
    with ScriptedServer([Reply(content="ok")]) as server:
        model = art.Model(name="m", inference_base_url=server.base_url, inference_api_key="k")

        @base.wrap_rollout(model)
        async def rollout() -> float:
            client = async_openai_client(
                server.base_url, "k", max_retries=0
            )  # a recording client still records
            await client.chat.completions.create(model="m", messages=USER)
            return 1.0

        with caplog.at_level(logging.WARNING, logger="art_adapters.adapters.base"):
            trajectory = await rollout()
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 1
    assert "has no _transport_for_url" in caplog.text and not base.hook_installed()


async def test_choices_carry_the_sampling_they_came_from() -> None:
    with ScriptedServer([Reply(content="a"), Reply(content="b")]) as server:
        client = async_openai_client(
            server.base_url, "k", request_token_ids=True, annotate_choices=True, max_retries=0
        )
        plain = await client.chat.completions.create(model="m", messages=USER, temperature=0.7)
        guided = await client.chat.completions.create(
            model="m", messages=USER, top_p=0.5, response_format={"type": "json_object"}
        )
    assert plain.choices[0].model_extra["sampling"] == {"temperature": 0.7, "unreproducible": []}
    assert guided.choices[0].model_extra["sampling"] == {
        "temperature": 1.0,
        "unreproducible": ["top_p", "response_format"],
    }
