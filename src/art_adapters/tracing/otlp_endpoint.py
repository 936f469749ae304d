"""An OTLP/HTTP trace endpoint (`POST /v1/traces`, JSON or protobuf, gzip or not) whose GenAI spans become
Trajectories as their traces complete. Binds 127.0.0.1 by default; any other address needs an API key. Without
a key a request must name loopback in `Host` (and in `Origin`, when a browser sends one), as `serve` asks: a web
page whose name was rebound to 127.0.0.1 is refused. A body is bounded as sent and again as gunzipped.

    store = open_store("trajectories.db")
    with OTLPEndpoint(on_trajectory=lambda t: store.add(t, t.metadata["trace_id"])) as endpoint:
        ... OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint.url your agent ...   # or collect: endpoint.trajectories()

A trace becomes one trajectory, once: a span id seen before in its trace is dropped, and spans of a trace that
completed in the last `remember_s` (an exporter retrying a batch whose answer it lost, or a span later than
`complete_after_s`) are dropped and counted, never a second trajectory of the same trace. A trace that fails to
convert (a malformed message, a redaction hook that raises) is skipped and counted; the others of its batch go on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..http_limits import ConnectionLimits, uvicorn_config
from ..redaction import Redactor, drop_secrets
from ..trajectories import Trajectory
from ..untrusted import is_loopback, names_loopback
from ._foreign import RewardFn
from .otel_genai import trajectories_from_spans
from .otlp import OTLPError, OTLPTooLarge, Span, decode_request

log = logging.getLogger(__name__)


class _Trace:
    __slots__ = ("seen", "spans")

    def __init__(self, seen: float) -> None:
        self.seen = seen  # when its last span arrived (monotonic)
        self.spans: dict[str, Span] = {}  # span id -> span (a repeated id is the same span)


class OTLPEndpoint:
    """Receives spans; a trace becomes a Trajectory once its root span arrives (or `complete_after_s` after its
    last span, rootless: a timer completes it while the endpoint runs). At most `max_traces` incomplete traces are
    held (the oldest is completed early), at most `max_spans_per_trace` spans of one trace (more are dropped and
    counted) and `max_spans` of all (past it the oldest traces are completed early), and `max_trajectories` finished ones wait in `trajectories()` when no `on_trajectory` takes them.
    Spans of a trace completed in the last `remember_s` are dropped and counted (`late_spans`).
    `max_body_bytes` bounds a body as sent and as gunzipped; `limits` the connections it serves (their number, and
    deadlines for a request's head and body)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        on_trajectory: Callable[[Trajectory], Any] | None = None,
        reward: str | RewardFn | None = None,
        redact: Redactor | None = drop_secrets,
        max_body_bytes: int = 16 * 2**20,
        max_traces: int = 10_000,
        max_spans_per_trace: int = 10_000,
        max_spans: int = 1_000_000,
        max_trajectories: int = 10_000,
        complete_after_s: float = 30.0,
        remember_s: float = 600.0,
        limits: ConnectionLimits | None = None,
    ) -> None:
        if not api_key and not is_loopback(host):
            raise ValueError(f"an OTLP endpoint on {host!r} (beyond loopback) needs an api_key")
        for name, value in (
            ("max_traces", max_traces),
            ("max_spans_per_trace", max_spans_per_trace),
            ("max_spans", max_spans),
            ("max_trajectories", max_trajectories),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is a positive integer, not {value!r}")
        if not complete_after_s > 0 or not remember_s >= 0:  # NaN fails both
            raise ValueError("complete_after_s is a positive number of seconds, remember_s one >= 0")
        self.host, self.port, self.api_key = host, port, api_key
        self.on_trajectory = on_trajectory
        self.reward, self.redact = reward, redact
        self.max_body_bytes, self.max_traces = max_body_bytes, max_traces
        self.max_spans_per_trace, self.max_spans = max_spans_per_trace, max_spans
        self.max_trajectories, self.complete_after_s = max_trajectories, complete_after_s
        self.remember_s = remember_s
        self.limits = limits or ConnectionLimits()
        self.dropped = 0  # finished trajectories no one took (the buffer was full)
        self.rejected = 0  # requests refused (bad key, Host or Origin, body, type)
        self.duplicate_spans = 0  # spans whose id its pending trace already held
        self.late_spans = 0  # spans of a trace already completed (a retried batch, a span after the timeout)
        self.overflow_spans = 0  # spans past `max_spans_per_trace`
        self.failed_traces = (
            0  # traces that did not convert (malformed, or the redaction hook raised): skipped
        )
        self._pending: OrderedDict[str, _Trace] = OrderedDict()
        self._held = 0  # spans of all pending traces
        self._finished: OrderedDict[str, float] = OrderedDict()  # trace id -> when it completed (monotonic)
        self._done: list[Trajectory] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1/traces"

    # ---- spans -> trajectories ---------------------------------------------------------------------------------
    def add_spans(self, spans: list[Span]) -> int:
        """Take spans (as decoded); returns how many trajectories this completed."""
        ready: list[tuple[str, list[Span]]] = []
        now = time.monotonic()
        late = 0
        with self._lock:
            self._forget(now)
            for span in spans:
                trace_id, span_id = span["trace_id"], span["span_id"]
                if trace_id in self._finished:
                    late += 1
                    continue
                trace = self._pending.pop(trace_id, None) or _Trace(now)
                trace.seen = now
                self._pending[trace_id] = trace  # the most recently active last
                root = span["parent_span_id"] is None
                if span_id in trace.spans:
                    self.duplicate_spans += 1
                elif len(trace.spans) >= self.max_spans_per_trace and not root:
                    self.overflow_spans += 1
                else:
                    trace.spans[span_id] = span
                    self._held += 1
                if root:
                    ready.append(self._complete(trace_id, now))
            while len(self._pending) > self.max_traces or (self._pending and self._held > self.max_spans):
                ready.append(self._complete(next(iter(self._pending)), now))
            ready += self._expired(now)
            self.late_spans += late
        if late:
            log.warning(
                "%d spans of traces already completed dropped (a retried batch, or spans more than "
                "complete_after_s=%gs after the trace's last: raise it for agents that pause longer)",
                late,
                self.complete_after_s,
            )
        return self._finish(ready)

    def sweep(self) -> int:
        """Complete the traces idle for `complete_after_s` (rootless); the endpoint's timer calls it while it runs."""
        with self._lock:
            ready = self._expired(time.monotonic())
        return self._finish(ready)

    def flush(self) -> int:
        """Complete every pending trace now (rootless ones too)."""
        now = time.monotonic()
        with self._lock:
            ready = [self._complete(trace_id, now) for trace_id in list(self._pending)]
        return self._finish(ready)

    def _complete(self, trace_id: str, now: float) -> tuple[str, list[Span]]:
        """Take a pending trace out (the lock held) and remember it completed."""
        trace = self._pending.pop(trace_id)
        self._held -= len(trace.spans)
        self._finished.pop(trace_id, None)
        self._finished[trace_id] = now
        while len(self._finished) > 10 * self.max_traces:
            self._finished.popitem(last=False)
        return trace_id, list(trace.spans.values())

    def _expired(self, now: float) -> list[tuple[str, list[Span]]]:
        idle = [t for t, trace in self._pending.items() if now - trace.seen > self.complete_after_s]
        return [self._complete(trace_id, now) for trace_id in idle]

    def _forget(self, now: float) -> None:
        while self._finished and now - next(iter(self._finished.values())) > self.remember_s:
            self._finished.popitem(last=False)

    def _finish(self, traces: list[tuple[str, list[Span]]]) -> int:
        made = 0
        for trace_id, members in traces:
            try:  # one trace at a time: a bad one is skipped, never the batch it came with
                trajectories = trajectories_from_spans(members, reward=self.reward, redact=self.redact)
            except (Exception, RecursionError) as error:
                with self._lock:
                    self.failed_traces += 1
                log.warning(
                    "trace %s skipped: it does not convert (%s: %s)", trace_id, type(error).__name__, error
                )
                continue
            for trajectory in trajectories:
                made += 1
                self._deliver(trajectory)
        return made

    def _deliver(self, trajectory: Trajectory) -> None:
        if self.on_trajectory is not None:
            try:
                self.on_trajectory(trajectory)
            except Exception:  # a failing sink must not take the endpoint down
                log.exception("on_trajectory failed for trace %s", trajectory.metadata.get("trace_id"))
            return
        with self._lock:
            if len(self._done) >= self.max_trajectories:
                self.dropped += 1
            else:
                self._done.append(trajectory)

    def _tick(self) -> None:
        interval = min(max(self.complete_after_s / 4, 0.01), 1.0)
        while not self._stopping.wait(interval):
            try:
                self.sweep()
            except Exception:  # pragma: no cover - _finish isolates traces; the timer must go on regardless
                log.exception("the OTLP endpoint's timer failed to complete idle traces")

    def trajectories(self) -> list[Trajectory]:
        """The finished trajectories waiting (taken: a second call returns only newer ones)."""
        with self._lock:
            out, self._done = self._done, []
        return out

    # ---- HTTP --------------------------------------------------------------------------------------------------
    async def _receive(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        def refuse(status: int, message: str) -> Any:
            self.rejected += 1
            return JSONResponse({"code": status, "message": message}, status_code=status)

        if not self.api_key and not names_loopback(
            request.headers.get("host"), request.headers.get("origin")
        ):
            return refuse(403, "Host or Origin not allowed on this keyless endpoint")
        if self.api_key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return refuse(401, "bad or missing API key")
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("application/json", "application/x-protobuf"):
            return refuse(415, "OTLP/HTTP bodies are application/json or application/x-protobuf")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return refuse(413, f"body over {self.max_body_bytes} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return refuse(413, f"body over {self.max_body_bytes} bytes")
        try:
            spans = decode_request(
                body, kind, request.headers.get("content-encoding", ""), max_bytes=self.max_body_bytes
            )
        except OTLPTooLarge as error:
            return refuse(413, str(error))
        except OTLPError as error:
            return refuse(400, str(error))
        except RecursionError:  # a parser nested past Python's stack (protobuf's own nesting checks aside)
            return refuse(400, "an OTLP trace export request nested too deep")
        await asyncio.to_thread(self.add_spans, spans)
        if kind == "application/x-protobuf":  # an empty ExportTraceServiceResponse
            return Response(b"", media_type="application/x-protobuf")
        return JSONResponse({})

    def start(self) -> OTLPEndpoint:
        import socket

        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        if not self.port:
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = int(probe.getsockname()[1])
        app = Starlette(routes=[Route("/v1/traces", self._receive, methods=["POST"])])
        config = uvicorn_config(
            app,
            host=self.host,
            port=self.port,
            limits=self.limits,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"art-otlp-{self.port}", daemon=True)
        self._thread.start()
        self._stopping.clear()
        self._timer = threading.Thread(target=self._tick, name=f"art-otlp-timer-{self.port}", daemon=True)
        self._timer.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the OTLP endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._thread = None
        self._stopping.set()
        if self._timer is not None:
            self._timer.join(10)
            self._timer = None
        self.flush()

    def __enter__(self) -> OTLPEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
