"""One incoming trace as the OTLP endpoint holds it until it completes: its spans by id, its log events (deduplicated
by their timestamped identity), and whether every inference call has its messages yet."""

from __future__ import annotations

import json

from .otel_genai import call_of, is_inference
from .otlp import LogEvent, Span, join_logs


class PendingTrace:
    __slots__ = ("log_keys", "logs", "rooted", "seen", "spans")

    def __init__(self, seen: float) -> None:
        self.seen = seen  # when its last span or log arrived (monotonic)
        self.spans: dict[str, Span] = {}  # span id -> span (a repeated id is the same span)
        self.logs: list[LogEvent] = []  # log events of its spans, in arrival order
        self.log_keys: set[str] = (
            set()
        )  # the timestamped ones already held (an exporter's retry sends them again)
        self.rooted: float | None = None  # when its root came, while it waits for its calls' log events

    def joined(self) -> list[Span]:
        """Its spans, each with the log events of its span id appended to its own events."""
        return join_logs(list(self.spans.values()), self.logs)

    def unmatched_logs(self) -> int:  # log events whose span is not (yet) here
        return sum(event["span_id"] not in self.spans for event in self.logs)

    def has_messages(self) -> bool:
        """Every inference span has messages in and an answer out, unless it failed (or it does not convert:
        nothing to wait for)."""
        for span in self.joined():
            if is_inference(span):
                try:
                    call = call_of(span)
                except Exception:  # noqa: BLE001 - _finish counts it; waiting will not mend it
                    return True
                if not call.request.get("messages") or (call.response is None and call.error is None):
                    return False  # (a failed call has no answer to wait for)
        return True


def log_key(event: LogEvent) -> str | None:
    """What makes a log event the same one sent again (None for one without a timestamp: never deduplicated)."""
    if not event["time_ns"]:
        return None
    return json.dumps(
        [event["span_id"], event["name"], event["time_ns"], event["attributes"]], sort_keys=True, default=repr
    )
