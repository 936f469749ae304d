"""OTLP log events joined to their spans: the official OpenAI instrumentation (opentelemetry-instrumentation-openai-v2)
in its default configuration writes a call's messages as log events, not span attributes. Driven end to end: the
real OpenAI SDK, instrumented by the real package, exporting through the real OTLP/HTTP exporters to our endpoint,
against a scripted OpenAI-compatible server; logs before their spans, and after."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from art_adapters.testing import ScriptedServer
from art_adapters.tracing import otlp
from art_adapters.tracing.otlp_endpoint import OTLPEndpoint

pytest.importorskip("opentelemetry.instrumentation.openai_v2")


def reward_missing(trajectory: Any) -> bool:
    return trajectory.metadata.get("reward_missing") is True


QUESTION = "What is the capital of France?"
ANSWER = "Paris."


class Instrumented:
    """The official instrumentation on a tracer and a logger provider of our own, exporting to `endpoint`."""

    def __init__(self, endpoint: OTLPEndpoint, *, batch_logs: bool = False) -> None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, SimpleLogRecordProcessor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        resource = Resource.create({"service.name": "capital-bot"})
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint.url, timeout=10))
        )
        self.logger_provider = LoggerProvider(resource=resource)
        log_exporter = OTLPLogExporter(endpoint=endpoint.logs_url, timeout=10)
        # batched with a long delay: nothing leaves before `flush_logs()`, so the spans arrive first
        processor = (
            BatchLogRecordProcessor(log_exporter, schedule_delay_millis=60_000)
            if batch_logs
            else SimpleLogRecordProcessor(log_exporter)
        )
        self.logger_provider.add_log_record_processor(processor)
        self.instrumentor = OpenAIInstrumentor()
        self.instrumentor.instrument(
            tracer_provider=self.tracer_provider, logger_provider=self.logger_provider
        )

    def flush_logs(self) -> None:
        self.logger_provider.force_flush()

    def close(self) -> None:
        self.instrumentor.uninstrument()
        self.tracer_provider.shutdown()
        self.logger_provider.shutdown()


@pytest.fixture
def capture_content(monkeypatch: pytest.MonkeyPatch) -> None:
    """Content capture as the instrumentation documents it, in log events (its default configuration otherwise):
    `true` on its legacy path (one event per message), `EVENT_ONLY` where its util-genai runs only the latest
    conventions (one `gen_ai.client.inference.operation.details` event per call)."""
    from opentelemetry.util.genai.utils import is_experimental_mode

    monkeypatch.delenv("OTEL_SEMCONV_STABILITY_OPT_IN", raising=False)
    value = "EVENT_ONLY" if is_experimental_mode() else "true"
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", value)


@pytest.fixture
def llm() -> Iterator[ScriptedServer]:
    with ScriptedServer([ANSWER], cycle=True) as server:
        yield server


def ask(llm: ScriptedServer, instrumented: Instrumented, reward: float | None) -> None:
    """One episode: a parent span carrying the reward (when given), one chat call inside it."""
    import openai

    client = openai.OpenAI(base_url=llm.base_url, api_key="sk-test", max_retries=0)
    tracer = instrumented.tracer_provider.get_tracer("capital-bot")
    attributes = {} if reward is None else {"app.reward": reward}
    with tracer.start_as_current_span("episode", attributes=attributes):
        answer = client.chat.completions.create(
            model="scripted-model",
            messages=[
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": QUESTION},
            ],
        )
    assert answer.choices[0].message.content == ANSWER


def wait_for(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the endpoint did not finish the trace in time"
        time.sleep(0.02)


def assert_the_conversation(trajectory: Any) -> None:
    assert trajectory.messages() == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
    ]
    assert trajectory.metadata["service"] == "capital-bot"


def test_logs_before_their_spans_make_a_trajectory_with_messages(capture_content: None, llm) -> None:
    with OTLPEndpoint(reward="app.reward") as endpoint:
        instrumented = Instrumented(endpoint)
        try:
            ask(llm, instrumented, reward=1.0)
        finally:
            instrumented.close()
        [trajectory] = endpoint.trajectories()  # the root span completed it: no waiting
    assert_the_conversation(trajectory)
    assert trajectory.reward == 1.0 and not reward_missing(trajectory)
    assert endpoint.unmatched_logs == 0 and endpoint.late_logs == 0


def test_logs_after_their_spans_are_waited_for(capture_content: None, llm) -> None:
    with OTLPEndpoint(reward="app.reward", log_wait_s=60) as endpoint:
        instrumented = Instrumented(endpoint, batch_logs=True)
        try:
            ask(llm, instrumented, reward=None)
            assert endpoint.trajectories() == []  # the root came, its call's messages did not: waiting
            instrumented.flush_logs()
            wait_for(lambda: endpoint._done)
        finally:
            instrumented.close()
        [trajectory] = endpoint.trajectories()
    assert_the_conversation(trajectory)
    assert reward_missing(trajectory) and trajectory.reward == 0.0 and endpoint.missing_rewards == 1


def test_without_content_capture_a_trace_is_counted_and_skipped(
    monkeypatch: pytest.MonkeyPatch, llm, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with OTLPEndpoint(reward="app.reward") as endpoint:
        instrumented = Instrumented(endpoint)
        try:
            for _ in range(2):
                ask(llm, instrumented, reward=1.0)
        finally:
            instrumented.close()
    assert endpoint.trajectories() == [] and endpoint.skipped_no_messages == 2
    warnings = [r.getMessage() for r in caplog.records if "carry no message" in r.getMessage()]
    assert len(warnings) == 1 and "/v1/logs" in warnings[0]  # once, then counted


def test_missing_reward_maps_on_the_endpoint(capture_content: None, llm) -> None:
    with OTLPEndpoint(reward="app.reward", missing_reward=0.25) as endpoint:
        instrumented = Instrumented(endpoint)
        try:
            ask(llm, instrumented, reward=None)
        finally:
            instrumented.close()
        [trajectory] = endpoint.trajectories()
    assert trajectory.reward == 0.25 and not reward_missing(trajectory)
    with pytest.raises(ValueError, match="missing_reward"):
        OTLPEndpoint(missing_reward=float("nan"))
    for wait in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="log_wait_s"):
            OTLPEndpoint(log_wait_s=wait)


# ---- OTLP/JSON logs, bounds, keys ------------------------------------------------------------------------------

TRACE, SPAN = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"


def logs_body(*records: dict[str, Any]) -> dict[str, Any]:
    return {"resourceLogs": [{"scopeLogs": [{"logRecords": list(records)}]}]}


def record(name: str, body: dict[str, Any], trace: str = TRACE, span: str = SPAN) -> dict[str, Any]:
    kv = [{"key": k, "value": {"stringValue": v}} for k, v in body.items()]
    return {"traceId": trace, "spanId": span, "eventName": name, "body": {"kvlistValue": {"values": kv}}}


def chat_span() -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": TRACE,
                                "spanId": SPAN,
                                "name": "chat m",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [
                                    {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                                    {"key": "app.reward", "value": {"doubleValue": 0.5}},
                                ],
                            }
                        ]
                    }
                ]
            }
        ]
    }


def post(endpoint: OTLPEndpoint, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        endpoint.base_url + path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
        timeout=10,
    )


def choice_record() -> dict[str, Any]:
    """A `gen_ai.choice` event whose body holds the assistant message, as the instrumentation writes it."""
    return {
        **record("gen_ai.choice", {}),
        "body": {
            "kvlistValue": {
                "values": [
                    {"key": "index", "value": {"intValue": "0"}},
                    {
                        "key": "message",
                        "value": {
                            "kvlistValue": {
                                "values": [
                                    {"key": "role", "value": {"stringValue": "assistant"}},
                                    {"key": "content", "value": {"stringValue": "hello"}},
                                ]
                            }
                        },
                    },
                ]
            }
        },
    }


def test_json_logs_join_in_either_order_and_bounds_hold() -> None:
    user = record("gen_ai.user.message", {"content": "hi"})
    choice = choice_record()
    with OTLPEndpoint(reward="app.reward", max_spans_per_trace=3) as endpoint:
        assert post(endpoint, "/v1/logs", logs_body(user)).status_code == 200
        assert post(endpoint, "/v1/traces", chat_span()).status_code == 200
        assert endpoint.trajectories() == []  # the root came without its answer: waiting for it
        stray = record("gen_ai.user.message", {"content": "x"}, span="0" * 15 + "1")
        assert post(endpoint, "/v1/logs", logs_body(stray, choice, user)).status_code == 200
        [trajectory] = endpoint.trajectories()
        assert trajectory.messages() == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
        assert trajectory.reward == 0.5
        assert endpoint.overflow_logs == 1 and endpoint.unmatched_logs == 1  # 3 per trace; one of no span
        assert post(endpoint, "/v1/logs", logs_body(user)).status_code == 200
        assert endpoint.late_logs == 1  # its trace completed: dropped, counted
        no_ids = {**user, "traceId": "", "spanId": ""}
        assert post(endpoint, "/v1/logs", logs_body(no_ids)).status_code == 200
        assert endpoint.unlinked_logs == 1
        assert post(endpoint, "/v1/logs", {"resourceLogs": 3}).status_code == 400
        assert post(endpoint, "/v1/logs", logs_body(user), host="evil.example").status_code == 403
    with OTLPEndpoint(api_key="k", max_body_bytes=100) as keyed:
        assert post(keyed, "/v1/logs", logs_body(user)).status_code == 401
        big = logs_body(*[user] * 10)
        assert post(keyed, "/v1/logs", big, authorization="Bearer k").status_code == 413


def test_unmatched_logs_are_held_no_longer_than_their_trace() -> None:
    user = record("gen_ai.user.message", {"content": "hi"})
    endpoint = OTLPEndpoint(max_traces=2)
    for n in range(5):  # logs of traces whose spans never come: at most max_traces traces held
        endpoint.add_logs(
            otlp.decode_logs_request(json.dumps(logs_body({**user, "traceId": f"{n:032x}"})).encode())
        )
        assert len(endpoint._pending) <= 2
    endpoint.flush()
    assert endpoint.unmatched_logs == 5 and endpoint._held == 0 and endpoint.trajectories() == []


def test_a_malformed_logs_request_names_the_problem() -> None:
    with pytest.raises(otlp.OTLPError, match="resourceLogs"):
        otlp.decode_logs_request(b'{"resourceSpans": 1, "resourceLogs": {}}')
    with pytest.raises(otlp.OTLPError, match="ExportLogsServiceRequest"):
        otlp.decode_logs_request(b"\xff\xff\xff", "application/x-protobuf")


def test_a_file_of_trace_and_log_requests_is_joined_too(tmp_path: Any) -> None:
    """The Collector's file exporter writes both signals as JSON lines: `read_otlp` joins them as the endpoint does."""
    from art_adapters.tracing.otel_genai import read_otlp

    user = record("gen_ai.user.message", {"content": "hi"})
    path = tmp_path / "export.jsonl"
    path.write_text(json.dumps(logs_body(user, choice_record())) + "\n" + json.dumps(chat_span()) + "\n")
    [trajectory] = read_otlp(path, reward="app.reward")
    assert trajectory.messages() == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert trajectory.reward == 0.5


def test_a_root_whose_logs_never_come_completes_after_log_wait_s() -> None:
    span = chat_span()
    endpoint = OTLPEndpoint(log_wait_s=0.05)
    endpoint.add_spans(otlp.spans_of(span))
    endpoint.add_spans(otlp.spans_of(span))  # the root again (a retried batch): no longer wait
    assert endpoint.trajectories() == [] and endpoint.duplicate_spans == 1
    wait_for(lambda: endpoint.sweep() or not endpoint._pending)
    assert endpoint.trajectories() == [] and endpoint.skipped_no_messages == 1  # calls without messages
