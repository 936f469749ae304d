"""Attack on the OTLP endpoint's /v1/logs (issue 37 §3): an exporter's retry sends a batch of log records again
(OTLP delivery is at-least-once), and must not repeat the conversation's messages; a record whose event name is not
a string is refused with a 400 naming it, not accepted and then poisoning its whole trace."""

from __future__ import annotations

from typing import Any

from art_adapters.tracing.otlp_endpoint import OTLPEndpoint
from test_otlp_logs import chat_span, choice_record, logs_body, post, record


def stamped(event: dict[str, Any], ns: int) -> dict[str, Any]:
    return {**event, "timeUnixNano": str(ns), "observedTimeUnixNano": str(ns)}


def test_a_retried_logs_batch_does_not_repeat_messages() -> None:
    system = stamped(record("gen_ai.system.message", {"content": "be brief"}), 1_000)
    user = stamped(record("gen_ai.user.message", {"content": "hi"}), 1_001)
    again = stamped(record("gen_ai.user.message", {"content": "hi"}), 1_002)  # the user said it twice: kept
    with OTLPEndpoint(reward="app.reward") as endpoint:
        for _ in range(2):  # the exporter timed out on the first and retried
            assert post(endpoint, "/v1/logs", logs_body(system, user, again)).status_code == 200
        assert post(endpoint, "/v1/traces", chat_span()).status_code == 200
        choice = stamped(choice_record(), 1_003)
        assert post(endpoint, "/v1/logs", logs_body(choice)).status_code == 200
        [trajectory] = endpoint.trajectories()
    assert trajectory.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert endpoint.duplicate_logs == 3


def test_an_event_name_of_the_wrong_type_is_refused() -> None:
    user = record("gen_ai.user.message", {"content": "hi"})
    with OTLPEndpoint(reward="app.reward") as endpoint:
        answer = post(endpoint, "/v1/logs", logs_body({**user, "eventName": {"a": 1}}))
        assert answer.status_code == 400 and "event name" in answer.text
        assert post(endpoint, "/v1/logs", logs_body(user, choice_record())).status_code == 200
        assert post(endpoint, "/v1/traces", chat_span()).status_code == 200
        [trajectory] = endpoint.trajectories()  # the well-formed trace still trains
    assert trajectory.messages()[0] == {"role": "user", "content": "hi"}
