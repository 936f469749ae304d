"""The OTLP endpoint under hostile or unlucky traffic: retried batches, repeated span ids, rootless traces with
no further traffic, a trace with endless spans, one bad trace in a batch, a redaction hook that raises, NaN
rewards, bodies nested too deep; and the docstring's store example, as written."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_adapters.store import open_store
from art_adapters.tracing.otlp import OTLPError, decode_request
from art_adapters.tracing.otlp_endpoint import OTLPEndpoint
from test_otel_genai import CURRENT, attr, export_request, span

T1, T2, T3 = "a" * 32, "b" * 32, "c" * 32


def chat(trace: str, sid: str, parent: str | None = "f" * 16, **extra: Any) -> dict[str, Any]:
    return span(trace, sid, parent, "chat gpt-prod", 1, {**CURRENT, **extra})


def root(trace: str, reward: Any = None) -> dict[str, Any]:
    out = span(trace, "f" * 16, None, "invoke_agent", 0, {})
    if reward is not None:
        out["attributes"].append({"key": "app.reward", "value": reward})
    return out


def spans(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return decode_request(json.dumps(export_request(list(items))).encode())


def wait_for(endpoint: OTLPEndpoint, n: int) -> list[Any]:
    """The trajectories once `n` arrived (a generous deadline: this waits, it does not time anything)."""
    got: list[Any] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += endpoint.trajectories()
        time.sleep(0.01)
    return got


def test_a_retried_batch_makes_no_second_trajectory() -> None:
    endpoint = OTLPEndpoint()
    batch = spans(chat(T1, "1" * 16), root(T1))
    assert endpoint.add_spans(batch) == 1
    assert endpoint.add_spans(batch) == 0  # the exporter lost our answer and sent it again
    (trajectory,) = endpoint.trajectories()
    assert len(trajectory.llm_calls) == 1 and endpoint.late_spans == 2


def test_a_span_id_repeated_in_a_trace_is_one_call() -> None:
    endpoint = OTLPEndpoint()
    endpoint.add_spans(spans(chat(T1, "1" * 16), chat(T1, "1" * 16)))
    endpoint.add_spans(spans(chat(T1, "1" * 16), root(T1)))
    (trajectory,) = endpoint.trajectories()
    assert len(trajectory.llm_calls) == 1 and endpoint.duplicate_spans == 2


def test_a_pause_longer_than_complete_after_s_makes_no_second_trajectory() -> None:
    endpoint = OTLPEndpoint(reward="app.reward", complete_after_s=0.05)
    endpoint.add_spans(spans(chat(T1, "1" * 16)))
    time.sleep(0.1)  # the agent waits on a slow tool; the trace completes rootless
    assert endpoint.sweep() == 1
    endpoint.add_spans(spans(chat(T1, "2" * 16), root(T1, {"doubleValue": 1.0})))
    (trajectory,) = endpoint.trajectories()
    assert trajectory.metadata["trace_id"] == T1 and endpoint.late_spans == 2


def test_a_rootless_trace_completes_on_the_timer_without_more_traffic() -> None:
    with OTLPEndpoint(complete_after_s=0.05) as endpoint:
        response = httpx.post(endpoint.url, json=export_request([chat(T1, "1" * 16)]), timeout=10)
        assert response.status_code == 200
        (trajectory,) = wait_for(endpoint, 1)
        assert trajectory.metadata["trace_id"] == T1 and not endpoint._pending


def test_spans_past_the_bound_of_one_trace_are_dropped_and_counted() -> None:
    endpoint = OTLPEndpoint(max_spans_per_trace=5)
    for k in range(20):
        endpoint.add_spans(spans(chat(T1, f"{k:016x}")))
    assert sum(len(t.spans) for t in endpoint._pending.values()) == 5 and endpoint.overflow_spans == 15
    endpoint.add_spans(spans(root(T1, {"doubleValue": 1.0})))  # the root still completes it
    (trajectory,) = endpoint.trajectories()
    assert len(trajectory.llm_calls) == 5


def test_one_bad_trace_does_not_lose_the_others_of_its_batch() -> None:
    endpoint = OTLPEndpoint()
    bad = chat(T2, "2" * 16, None)
    bad["attributes"] = [a for a in bad["attributes"] if a["key"] != "gen_ai.output.messages"]
    bad["attributes"].append(
        attr("gen_ai.output.messages", "[" * 5000 + "]" * 5000)
    )  # past the recursion limit
    assert endpoint.add_spans(spans(chat(T1, "1" * 16, None), bad, chat(T3, "3" * 16, None))) == 2
    assert sorted(t.metadata["trace_id"] for t in endpoint.trajectories()) == [T1, T3]
    assert endpoint.failed_traces == 1 and not endpoint._pending


def test_a_redaction_hook_raising_for_one_trace_skips_only_that_one() -> None:
    def redact(trajectory: Any) -> Any:
        if trajectory.metadata["trace_id"] == T2:
            raise RuntimeError("redactor bug")
        return trajectory

    endpoint = OTLPEndpoint(redact=redact)
    endpoint.add_spans(spans(chat(T1, "1" * 16, None), chat(T2, "2" * 16, None)))
    assert [t.metadata["trace_id"] for t in endpoint.trajectories()] == [T1]
    assert endpoint.failed_traces == 1


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_reward_is_no_reward(value: str) -> None:
    endpoint = OTLPEndpoint(reward="app.reward")
    endpoint.add_spans(spans(chat(T1, "1" * 16), root(T1, {"doubleValue": value})))
    (trajectory,) = endpoint.trajectories()
    assert trajectory.reward == 0.0 and trajectory.metadata["reward_missing"] is True


def test_an_integer_reward_past_floats_is_no_reward() -> None:
    endpoint = OTLPEndpoint(reward="app.reward")
    endpoint.add_spans(spans(chat(T1, "1" * 16), root(T1, {"intValue": "9" * 400})))
    (trajectory,) = endpoint.trajectories()
    assert trajectory.metadata["reward_missing"] is True


def test_a_body_nested_too_deep_is_a_400_and_a_mixed_batch_a_200() -> None:
    deep = b'{"resourceSpans": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(OTLPError, match="nested too deep"):
        decode_request(deep)
    with OTLPEndpoint() as endpoint:
        post = httpx.post(
            endpoint.url, content=deep, headers={"content-type": "application/json"}, timeout=30
        )
        assert post.status_code == 400 and "nested too deep" in post.json()["message"]
        bad = chat(T2, "2" * 16, None)
        bad["attributes"] = [a for a in bad["attributes"] if a["key"] != "gen_ai.input.messages"]
        bad["attributes"].append(attr("gen_ai.input.messages", "[" * 5000 + "]" * 5000))  # cannot convert
        mixed = httpx.post(endpoint.url, json=export_request([chat(T1, "1" * 16, None), bad]), timeout=30)
        assert mixed.status_code == 200
        assert [t.metadata["trace_id"] for t in endpoint.trajectories()] == [T1]


def test_a_malformed_field_is_a_400_naming_it() -> None:
    item = chat(T1, "1" * 16)
    item["startTimeUnixNano"] = "soon"
    with pytest.raises(OTLPError, match="soon"):
        decode_request(json.dumps(export_request([item])).encode())
    with OTLPEndpoint() as endpoint:
        post = httpx.post(endpoint.url, json=export_request([item]), timeout=30)
        assert post.status_code == 400 and "soon" in post.json()["message"]


def test_the_docstring_store_example_stores_the_trace(tmp_path: Path) -> None:
    from art_adapters.tracing import otlp_endpoint

    assert 'on_trajectory=lambda t: store.add(t, t.metadata["trace_id"])' in (otlp_endpoint.__doc__ or "")
    store = open_store(str(tmp_path / "trajectories.db"))
    with OTLPEndpoint(on_trajectory=lambda t: store.add(t, t.metadata["trace_id"])) as endpoint:
        response = httpx.post(endpoint.url, json=export_request([chat(T1, "1" * 16), root(T1)]), timeout=10)
        assert response.status_code == 200
    assert store.counts()["trajectories"] == 1


def test_spans_of_all_pending_traces_are_bounded() -> None:
    endpoint = OTLPEndpoint(max_spans=4)
    for k in range(10):
        endpoint.add_spans(spans(chat(f"{k:032x}", "1" * 16), chat(f"{k:032x}", "2" * 16)))
    assert sum(len(t.spans) for t in endpoint._pending.values()) <= 4
    assert len(endpoint.trajectories()) == 8  # the oldest completed early, none lost


def test_bounds_that_would_hold_nothing_are_refused() -> None:
    for bad in ({"max_spans_per_trace": 0}, {"max_spans": -1}, {"complete_after_s": float("nan")}):
        with pytest.raises(ValueError):
            OTLPEndpoint(**bad)
