"""The Langfuse SDK kept at arm's length: bounded SDK calls, its log lines counted or folded into one warning."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..trajectories import Trajectory, TrajectoryGroup

Exportable = Trajectory | TrajectoryGroup | Iterable["Trajectory | TrajectoryGroup"]

log = logging.getLogger("art_adapters.tracing.langfuse")


def quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as error:
        log.warning("Langfuse SDK call failed: %r", error)


def flatten(items: Exportable, group_index: int | None) -> list[tuple[int | None, int | None, Trajectory]]:
    if isinstance(items, Trajectory):
        return [(group_index, None, items)]
    if isinstance(items, TrajectoryGroup):
        return [(group_index, i, t) for i, t in enumerate(items.trajectories)]
    out: list[tuple[int | None, int | None, Trajectory]] = []
    for gi, item in enumerate(items):
        if isinstance(item, TrajectoryGroup):
            out += [(gi, i, t) for i, t in enumerate(item.trajectories)]
        elif isinstance(item, Trajectory):
            out.append((group_index, gi, item))
    return out


class Unreachable(logging.Filter):
    """Takes the OpenTelemetry exporter's per-batch retry and failure lines off the log: the first one becomes a
    single warning that Langfuse is not answering; the rest are only counted. It stays on those loggers after
    `close()` (the SDK's bounded shutdown may still be retrying in its own thread)."""

    LOGGERS = (
        "opentelemetry.exporter.otlp.common.http",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    )

    def __init__(self, say_unreachable: Callable[[str], None], url: str) -> None:
        super().__init__()
        self.say_unreachable = say_unreachable
        self.url = url
        self.failures = 0
        self.said = False

    def install(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.failures += 1
        if not self.said:
            self.said = True
            self.say_unreachable(self.url)
        return False


class ErrorCounter(logging.Handler):
    """Collects the errors the Langfuse SDK logs (failed exports), so `flush()` can report them."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self._messages: deque[str] = deque(maxlen=100)

    def emit(self, record: logging.LogRecord) -> None:
        self._messages.append(record.getMessage()[:300])

    def take(self) -> list[str]:
        out = list(self._messages)
        self._messages.clear()
        return out
