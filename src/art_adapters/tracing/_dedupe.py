"""Dedupe against Langfuse's own instrumentation: remember the generations it sent, match captured calls to them."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from ..trajectories import LLMCall
from ._convert import ns

log = logging.getLogger(__name__)

OURS = "art_adapters.exported"  # span attribute marking the spans this exporter made
_MATCH_TOLERANCE_NS = 50_000_000


class HandlerGenerations:
    """Generation spans other Langfuse instrumentation (e.g. the LangChain CallbackHandler) ended, for matching."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: deque[tuple[int, int, str | None, str]] = deque(maxlen=10_000)

    def record(self, span: Any) -> None:
        attrs = span.attributes or {}
        if attrs.get("langfuse.observation.type") != "generation" or attrs.get(OURS):
            return
        ids = f"{span.context.trace_id:032x}/{span.context.span_id:016x}"
        with self._lock:
            self._spans.append(
                (span.start_time, span.end_time, attrs.get("langfuse.observation.model.name"), ids)
            )

    def match(self, call: LLMCall) -> str | None:
        """The handler generation whose time window holds this call (same model), consumed once; or None."""
        start, end = ns(call.started_at), ns(call.ended_at)
        with self._lock:
            fits = [
                s
                for s in self._spans
                if s[0] <= start + _MATCH_TOLERANCE_NS
                and s[1] >= end - _MATCH_TOLERANCE_NS
                and (s[2] is None or call.model is None or s[2] == call.model)
            ]
            if not fits:
                return None
            best = min(fits, key=lambda s: s[1] - s[0])
            self._spans.remove(best)
        return best[3]


def install_recorder(client: Any) -> HandlerGenerations | None:
    try:
        from opentelemetry.sdk.trace import SpanProcessor

        provider = client._resources.tracer_provider
        recorder = HandlerGenerations()

        class _Recorder(SpanProcessor):
            def on_end(self, span: Any) -> None:
                recorder.record(span)

        provider.add_span_processor(_Recorder())
        return recorder
    except Exception as error:  # SDK internals moved: dedupe off, everything else works
        log.debug("Langfuse generation dedupe unavailable: %r", error)
        return None
