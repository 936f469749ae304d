"""An OTLP/HTTP trace and log endpoint (`POST /v1/traces`, `POST /v1/logs`, JSON or protobuf, gzip or not) whose
GenAI spans, joined with their log events by trace and span id, become Trajectories as their traces complete.
Binds 127.0.0.1 by default; any other address needs an API key. Without a key a request must name loopback in
`Host` (and in `Origin`, when a browser sends one), as `serve` asks: a web page whose name was rebound to
127.0.0.1 is refused. A body is bounded as sent and again as gunzipped.

    store = open_store("trajectories.db")
    with OTLPEndpoint(on_trajectory=lambda t: store.add(t, t.metadata["trace_id"])) as endpoint:
        ... OTEL_EXPORTER_OTLP_ENDPOINT=endpoint.base_url your agent ...   # or collect: endpoint.trajectories()

A trace becomes one trajectory, once: a span id seen before in its trace is dropped, and spans of a trace that
completed in the last `remember_s` (an exporter retrying a batch whose answer it lost, or a span later than
`complete_after_s`) are dropped and counted, never a second trajectory of the same trace. A trace that fails to
convert (a malformed message, a redaction hook that raises) is skipped and counted; the others of its batch go on.
The official OpenAI instrumentation writes a call's messages as log events, exported apart from its spans and in
either order: logs are held in their trace (by the same bounds as spans), and a trace whose root came while one
of its calls still lacks its messages waits up to `log_wait_s` for them.
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
from ._otlp_pending import PendingTrace, log_key
from .otel_genai import NO_MESSAGES, trajectories_from_spans
from .otlp import (
    LogEvent,
    OTLPError,
    OTLPTooLarge,
    Span,
    decode_logs_request,
    decode_request,
)

log = logging.getLogger(__name__)


class OTLPEndpoint:
    """Receives spans and log events; a trace becomes a Trajectory once its root span arrives and each of its calls
    has its messages (or `log_wait_s` after the root; or `complete_after_s` after its last span or log, rootless: a
    timer completes it while the endpoint runs). At most `max_traces` incomplete traces are held (the oldest is
    completed early), at most `max_spans_per_trace` spans, and as many log events, of one trace (more are dropped
    and counted) and `max_spans` spans and log events of all (past it the oldest traces are completed early), and
    `max_trajectories` finished ones wait in `trajectories()` when no `on_trajectory` takes them. Spans and logs of
    a trace completed in the last `remember_s` are dropped and counted (`late_spans`, `late_logs`). The reward:
    the span attribute named `reward` (or `reward(attributes)`); a trace without one gets `missing_reward`, or is
    flagged `reward_missing` (counted in `missing_rewards`). `max_body_bytes` bounds a body as sent and as
    gunzipped; `limits` the connections it serves (their number, and deadlines for a request's head and body)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        on_trajectory: Callable[[Trajectory], Any] | None = None,
        reward: str | RewardFn | None = None,
        missing_reward: float | None = None,
        redact: Redactor | None = drop_secrets,
        max_body_bytes: int = 16 * 2**20,
        max_traces: int = 10_000,
        max_spans_per_trace: int = 10_000,
        max_spans: int = 1_000_000,
        max_trajectories: int = 10_000,
        complete_after_s: float = 30.0,
        remember_s: float = 600.0,
        log_wait_s: float = 10.0,
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
        if not complete_after_s > 0 or not remember_s >= 0 or not 0 <= log_wait_s < float("inf"):  # NaN fails
            raise ValueError(
                "complete_after_s is a positive number of seconds, remember_s and log_wait_s finite ones >= 0"
            )
        if missing_reward is not None and not (
            isinstance(missing_reward, int | float) and abs(missing_reward) < float("inf")
        ):
            raise ValueError(f"missing_reward is a finite number or None, not {missing_reward!r}")
        self.host, self.port, self.api_key = host, port, api_key
        self.on_trajectory = on_trajectory
        self.reward, self.missing_reward, self.redact = reward, missing_reward, redact
        self.max_body_bytes, self.max_traces = max_body_bytes, max_traces
        self.max_spans_per_trace, self.max_spans = max_spans_per_trace, max_spans
        self.max_trajectories, self.complete_after_s = max_trajectories, complete_after_s
        self.remember_s, self.log_wait_s = remember_s, log_wait_s
        self.limits = limits or ConnectionLimits()
        self.dropped = 0  # finished trajectories no one took (the buffer was full)
        self.rejected = 0  # requests refused (bad key, Host or Origin, body, type)
        self.duplicate_spans = 0  # spans whose id its pending trace already held
        self.late_spans = 0  # spans of a trace already completed (a retried batch, a span after the timeout)
        self.overflow_spans = 0  # spans past `max_spans_per_trace`
        self.late_logs = 0  # log events of a trace already completed
        self.duplicate_logs = (
            0  # log events its pending trace already held (same span, name, time and content)
        )
        self.overflow_logs = 0  # log events past `max_spans_per_trace` in one trace
        self.unlinked_logs = 0  # log records with no trace or span id (not written inside a span)
        self.unmatched_logs = 0  # log events whose span never came with their trace
        self.skipped_no_messages = 0  # traces whose calls carried no message at all: no trajectory
        self.missing_rewards = 0  # trajectories made without a reward (flagged reward_missing, unless mapped)
        self.failed_traces = 0  # traces that did not convert (malformed, a redaction hook raised): skipped
        self._pending: OrderedDict[str, PendingTrace] = OrderedDict()
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
        """Where spans go (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)."""
        return f"{self.base_url}/v1/traces"

    @property
    def logs_url(self) -> str:
        """Where log events go (`OTEL_EXPORTER_OTLP_LOGS_ENDPOINT`)."""
        return f"{self.base_url}/v1/logs"

    @property
    def base_url(self) -> str:
        """`OTEL_EXPORTER_OTLP_ENDPOINT`: the exporters add /v1/traces and /v1/logs."""
        return f"http://{self.host}:{self.port}"

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
                trace = self._pending.pop(trace_id, None) or PendingTrace(now)
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
                if root and trace.rooted is None:  # a root sent again never extends the wait
                    trace.rooted = now
            ready += self._settle({span["trace_id"] for span in spans}, now)
            self.late_spans += late
        if late:
            log.warning(
                "%d spans of traces already completed dropped (a retried batch, or spans more than "
                "complete_after_s=%gs after the trace's last: raise it for agents that pause longer)",
                late,
                self.complete_after_s,
            )
        return self._finish(ready)

    def add_logs(self, events: list[LogEvent]) -> int:
        """Take log events (as decoded), held in their trace until it completes; returns how many trajectories
        this completed (a trace whose root waited for these)."""
        now = time.monotonic()
        with self._lock:
            self._forget(now)
            for event in events:
                trace_id = event["trace_id"]
                if not trace_id or not event["span_id"]:
                    self.unlinked_logs += 1
                    continue
                if trace_id in self._finished:
                    self.late_logs += 1
                    continue
                trace = self._pending.pop(trace_id, None) or PendingTrace(now)
                trace.seen = now
                self._pending[trace_id] = trace
                key = log_key(event)
                if key is not None and key in trace.log_keys:
                    self.duplicate_logs += 1
                elif len(trace.logs) >= self.max_spans_per_trace:
                    self.overflow_logs += 1
                else:
                    if key is not None:
                        trace.log_keys.add(key)
                    trace.logs.append(event)
                    self._held += 1
            ready = self._settle({e["trace_id"] for e in events}, now)
        return self._finish(ready)

    def _settle(self, touched: set[str], now: float) -> list[tuple[str, list[Span]]]:
        """(The lock held) the traces done: those of `touched` rooted and with their messages, then what the bounds
        push out, then the idle ones."""
        ready: list[tuple[str, list[Span]]] = []
        for trace_id in touched:
            trace = self._pending.get(trace_id)
            if trace is not None and trace.rooted is not None:
                if self.log_wait_s == 0 or trace.has_messages():
                    ready.append(self._complete(trace_id, now))
        while len(self._pending) > self.max_traces or (self._pending and self._held > self.max_spans):
            ready.append(self._complete(next(iter(self._pending)), now))
        return ready + self._expired(now)

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
        self._held -= len(trace.spans) + len(trace.logs)
        self.unmatched_logs += trace.unmatched_logs()
        self._finished.pop(trace_id, None)
        self._finished[trace_id] = now
        while len(self._finished) > 10 * self.max_traces:
            self._finished.popitem(last=False)
        return trace_id, trace.joined()

    def _expired(self, now: float) -> list[tuple[str, list[Span]]]:
        idle = [
            t
            for t, trace in self._pending.items()
            if now - trace.seen > self.complete_after_s
            or (trace.rooted is not None and now - trace.rooted > self.log_wait_s)
        ]
        return [self._complete(trace_id, now) for trace_id in idle]

    def _forget(self, now: float) -> None:
        while self._finished and now - next(iter(self._finished.values())) > self.remember_s:
            self._finished.popitem(last=False)

    def _finish(self, traces: list[tuple[str, list[Span]]]) -> int:
        made = 0
        for trace_id, members in traces:
            counts: dict[str, int] = {}
            try:  # one trace at a time: a bad one is skipped, never the batch it came with
                trajectories = trajectories_from_spans(
                    members,
                    reward=self.reward,
                    missing_reward=self.missing_reward,
                    redact=self.redact,
                    stats=counts,
                )
            except (Exception, RecursionError) as error:
                with self._lock:
                    self.failed_traces += 1
                log.warning(
                    "trace %s skipped: it does not convert (%s: %s)", trace_id, type(error).__name__, error
                )
                continue
            with self._lock:
                first = counts.get("no_messages", 0) and not self.skipped_no_messages
                self.skipped_no_messages += counts.get("no_messages", 0)
                self.missing_rewards += counts.get("no_reward", 0)
            if first:  # once: the counter says how many more
                log.warning("trace %s skipped (and every such trace, counted): %s", trace_id, NO_MESSAGES)
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
        return await self._serve(request, logs=False)

    async def _receive_logs(self, request: Any) -> Any:
        return await self._serve(request, logs=True)

    async def _serve(self, request: Any, *, logs: bool) -> Any:
        """One export request, traces or logs: the same key, Host, type and size checks for both."""
        from starlette.responses import JSONResponse, Response

        what = "log" if logs else "trace"

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
        decode = decode_logs_request if logs else decode_request
        try:
            records = decode(
                body, kind, request.headers.get("content-encoding", ""), max_bytes=self.max_body_bytes
            )
        except OTLPTooLarge as error:
            return refuse(413, str(error))
        except OTLPError as error:
            return refuse(400, str(error))
        except RecursionError:  # a parser nested past Python's stack (protobuf's own nesting checks aside)
            return refuse(400, f"an OTLP {what} export request nested too deep")
        await asyncio.to_thread(self.add_logs if logs else self.add_spans, records)
        if kind == "application/x-protobuf":  # an empty Export{Trace,Logs}ServiceResponse
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
        app = Starlette(
            routes=[
                Route("/v1/traces", self._receive, methods=["POST"]),
                Route("/v1/logs", self._receive_logs, methods=["POST"]),
            ]
        )
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
