"""OpenTelemetry GenAI spans as Trajectories: OTLP/JSON files, and our OTLP/HTTP endpoint fed by the real
OpenTelemetry SDK exporter (protobuf) and by plain JSON posts; its bounds (gzip bombs too), its key, and without a
key its loopback-only Host and Origin rule."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_adapters.tracing.otel_genai import read_otlp
from art_adapters.tracing.otlp import OTLPError, OTLPTooLarge, decode_request
from art_adapters.tracing.otlp_endpoint import OTLPEndpoint


def attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    if isinstance(value, list):
        return {"key": key, "value": {"arrayValue": {"values": [{"stringValue": v} for v in value]}}}
    return {"key": key, "value": {"stringValue": value}}


def span(
    trace: str, sid: str, parent: str | None, name: str, t: int, attrs: dict[str, Any], events=()
) -> dict:
    return {
        "traceId": trace,
        "spanId": sid,
        **({"parentSpanId": parent} if parent else {}),
        "name": name,
        "startTimeUnixNano": str(t * 10**9),
        "endTimeUnixNano": str((t + 1) * 10**9),
        "attributes": [attr(k, v) for k, v in attrs.items()],
        "events": list(events),
    }


TRACE = "5b8efff798038103d269b633813fc60c"
CURRENT = {  # gen_ai.* as the current conventions put them on the span
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "gpt-prod",
    "gen_ai.request.temperature": 0.5,
    "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Use tools."}]),
    "gen_ai.input.messages": json.dumps(
        [{"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}]
    ),
    "gen_ai.output.messages": json.dumps(
        [
            {
                "role": "assistant",
                "parts": [
                    {"type": "tool_call", "id": "c1", "name": "weather", "arguments": {"city": "Paris"}}
                ],
                "finish_reason": "tool_call",
            }
        ]
    ),
    "gen_ai.tool.definitions": json.dumps(
        [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    ),
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.usage.output_tokens": 5,
}
SECOND = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "gpt-prod",
    "gen_ai.input.messages": json.dumps(
        [
            {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "parts": [
                    {"type": "tool_call", "id": "c1", "name": "weather", "arguments": {"city": "Paris"}}
                ],
            },
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "sunny"}]},
        ]
    ),
    "gen_ai.output.messages": json.dumps(
        [{"role": "assistant", "parts": [{"type": "text", "content": "Sunny."}]}]
    ),
}


def export_request(spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [attr("service.name", "support-bot")]},
                "scopeSpans": [{"scope": {"name": "test"}, "spans": spans}],
            }
        ]
    }


def test_otlp_json_file_current_and_older_conventions(tmp_path: Path) -> None:
    legacy_trace = "0af7651916cd43dd8448eb211c80319c"
    spans = [
        span(
            TRACE,
            "a" * 16,
            None,
            "invoke_agent",
            100,
            {"app.reward": 0.75, "gen_ai.conversation.id": "conv-9"},
        ),
        span(TRACE, "b" * 16, "a" * 16, "chat gpt-prod", 100, CURRENT),
        span(
            TRACE, "c" * 16, "a" * 16, "execute_tool weather", 101, {"gen_ai.operation.name": "execute_tool"}
        ),
        span(TRACE, "d" * 16, "a" * 16, "chat gpt-prod", 102, SECOND),
        span(  # OpenLLMetry's indexed attributes, and the per-message events
            legacy_trace,
            "e" * 16,
            None,
            "openai.chat",
            200,
            {
                "gen_ai.prompt.0.role": "user",
                "gen_ai.prompt.0.content": "Hi, key sk-abcdefghijklmnopqrstuvwx",
                "gen_ai.completion.0.role": "assistant",
                "gen_ai.completion.0.content": "Hello!",
                "gen_ai.request.model": "m2",
                "app.reward": True,
            },
        ),
    ]
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(export_request(spans)))
    trajectories = {t.metadata["trace_id"]: t for t in read_otlp(path, reward="app.reward")}
    main, legacy = trajectories[TRACE], trajectories[legacy_trace]
    assert main.reward == 0.75 and legacy.reward == 1.0
    assert main.metadata["trace_source"] == "otel_genai" and main.metadata["sampled_token_ids"] is False
    assert main.metadata["service"] == "support-bot" and main.metadata["conversation_id"] == "conv-9"
    assert [c.model for c in main.llm_calls] == ["gpt-prod", "gpt-prod"]
    assert main.llm_calls[0].request["temperature"] == 0.5
    assert main.llm_calls[0].request["tools"][0]["function"]["name"] == "weather"
    assert all(c.prompt_token_ids is None for c in main.llm_calls)
    messages = main.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[-1]["content"] == "Sunny."
    assert legacy.messages()[0]["content"] == "Hi, key [REDACTED]"  # the default redaction
    # the file exporter's JSON lines read too
    lines = tmp_path / "lines.jsonl"
    lines.write_text("\n".join(json.dumps(export_request([s])) for s in spans))
    assert len(read_otlp(lines, reward="app.reward")) == 2


def test_the_sdks_otlp_exporter_feeds_our_endpoint() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    with OTLPEndpoint(reward="app.reward") as endpoint:
        provider = TracerProvider(resource=Resource.create({"service.name": "bot"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint.url, timeout=10)))
        tracer = provider.get_tracer("test")
        for reward in (0.0, 1.0):
            with tracer.start_as_current_span("invoke_agent") as root:
                root.set_attribute("app.reward", reward)
                with tracer.start_as_current_span("chat gpt-prod") as chat:
                    for key, value in CURRENT.items():
                        chat.set_attribute(key, value)
        provider.shutdown()
        trajectories = endpoint.trajectories()
    assert sorted(t.reward for t in trajectories) == [0.0, 1.0]  # each trace completed by its root span
    assert all(t.messages()[0] == {"role": "system", "content": "Use tools."} for t in trajectories)


def test_endpoint_bounds_and_keys() -> None:
    with pytest.raises(ValueError, match="needs an api_key"):
        OTLPEndpoint(host="0.0.0.0")
    body = json.dumps(export_request([span(TRACE, "b" * 16, None, "chat", 1, CURRENT)]))
    with OTLPEndpoint(api_key="k3y", max_body_bytes=len(body) + 10) as endpoint:

        def post(content: str | bytes, **headers: str) -> httpx.Response:
            return httpx.post(endpoint.url, content=content, headers=headers, timeout=10)

        assert post(body, **{"content-type": "application/json"}).status_code == 401
        ok = {"content-type": "application/json", "authorization": "Bearer k3y"}
        assert post(body, **ok).status_code == 200 and post(body, **ok).json() == {}
        assert post(body + " " * 20, **ok).status_code == 413
        assert post("{}", **{**ok, "content-type": "text/plain"}).status_code == 415
        assert post('{"resourceSpans": [{"scopeSpans": [{"spans": [{}]}]}]}', **ok).status_code == 400
        assert post(b"\x00garbage", **{**ok, "content-type": "application/x-protobuf"}).status_code == 400
        # the same body twice (an exporter retrying): one trajectory, the retry's span dropped and counted
        assert len(endpoint.trajectories()) == 1 and endpoint.rejected == 5 and endpoint.late_spans == 1


def gzip_bomb(unpacked_mib: int) -> bytes:
    """`unpacked_mib` MiB of spaces as one gzip member of a few KiB, made without holding the spaces."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b" " * 2**20
    return b"".join(packer.compress(block) for _ in range(unpacked_mib)) + packer.flush()


def test_a_gzip_bomb_unpacks_no_further_than_the_limit() -> None:
    """`gzip.decompress` had no bound: 64 MiB of spaces in ~64 KiB of gzip were all held before JSON refused them
    (16 MiB, the body limit, became 16 GiB). Now the unpacking stops one byte past the limit."""
    bomb = gzip_bomb(64)
    assert len(bomb) < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(OTLPTooLarge, match="decompresses to over 1048576 bytes"):
            decode_request(bomb, "application/json", "gzip", max_bytes=2**20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak} bytes held while refusing a 64 MiB gzip bomb"
    body = json.dumps(export_request([span(TRACE, "b" * 16, None, "chat", 1, CURRENT)])).encode()
    packed = (
        gzip.compress(body) + b"\x00" * 4 + gzip.compress(b" ")
    )  # padding and members, as gzip reads them
    assert len(decode_request(packed, "application/json", "gzip", max_bytes=len(body) + 1)) == 1
    with pytest.raises(OTLPTooLarge):
        decode_request(packed, "application/json", "gzip", max_bytes=len(body))
    for broken in (gzip.compress(body)[:-9], gzip.compress(body) + b"junk", b"\x1f\x8bnot gzip"):
        with pytest.raises(OTLPError, match="gzip body does not decompress"):
            decode_request(broken, "application/json", "gzip")


def test_endpoint_refuses_a_gzip_bomb_with_413_and_keeps_serving() -> None:
    body = json.dumps(export_request([span(TRACE, "b" * 16, None, "chat", 1, CURRENT)])).encode()
    with OTLPEndpoint(max_body_bytes=64 * 2**10) as endpoint:
        json_type = {"content-type": "application/json"}
        for headers in (
            {**json_type, "content-encoding": "gzip"},
            json_type,
        ):  # declared, or found by its magic
            refused = httpx.post(endpoint.url, content=gzip_bomb(16), headers=headers, timeout=30)
            assert refused.status_code == 413 and "decompresses to over 65536 bytes" in refused.text
        packed = gzip.compress(body)
        ok = httpx.post(
            endpoint.url, content=packed, headers={**json_type, "content-encoding": "gzip"}, timeout=30
        )
        assert ok.status_code == 200
        assert len(endpoint.trajectories()) == 1 and endpoint.rejected == 2


def test_a_keyless_endpoint_answers_only_requests_that_name_loopback() -> None:
    """A web page whose DNS name was rebound to 127.0.0.1 (its Host and Origin are its own name) posted spans to
    the keyless endpoint; `serve`'s rule now holds here too: Host, and Origin when sent, name loopback."""
    body = json.dumps(export_request([span(TRACE, "b" * 16, None, "chat", 1, CURRENT)]))
    json_type = {"content-type": "application/json"}
    with OTLPEndpoint() as endpoint:

        def post(**headers: str) -> httpx.Response:
            return httpx.post(endpoint.url, content=body, headers={**json_type, **headers}, timeout=10)

        for refused in (
            {"host": "evil.example"},
            {"host": f"evil.example:{endpoint.port}"},
            {"origin": "http://evil.example"},
            {"origin": "null"},  # a sandboxed frame or a file:// page
            {"host": "[::1"},  # does not parse: names nothing
        ):
            answer = post(**refused)
            assert answer.status_code == 403 and "Host or Origin" in answer.text, refused
        assert endpoint.trajectories() == [] and endpoint.rejected == 5
        for accepted in (
            {},
            {"host": f"localhost:{endpoint.port}"},
            {"origin": f"http://127.0.0.1:{endpoint.port}"},
            {"host": "[::1]", "origin": "https://localhost"},
        ):
            assert post(**accepted).status_code == 200, accepted
        # each accepted; the same trace four times is one trajectory, the repeats' spans dropped and counted
        assert len(endpoint.trajectories()) == 1 and endpoint.late_spans == 3
    with OTLPEndpoint(api_key="k3y") as keyed:  # a key is the check: any name may reach it, as serve's
        answer = httpx.post(
            keyed.url,
            content=body,
            headers={**json_type, "host": "otlp.internal", "authorization": "Bearer k3y"},
            timeout=10,
        )
        assert answer.status_code == 200
