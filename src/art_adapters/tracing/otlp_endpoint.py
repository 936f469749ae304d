"""An OTLP/HTTP trace endpoint (`POST /v1/traces`, JSON or protobuf, gzip or not) whose GenAI spans become
Trajectories as their traces complete. Binds 127.0.0.1 by default; any other address needs an API key. Without
a key a request must name loopback in `Host` (and in `Origin`, when a browser sends one), as `serve` asks: a web
page whose name was rebound to 127.0.0.1 is refused. A body is bounded as sent and again as gunzipped.

    with OTLPEndpoint(on_trajectory=store.add) as endpoint:     # or collect: endpoint.trajectories()
        ... OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint.url your agent ...
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


class OTLPEndpoint:
    """Receives spans; a trace becomes a Trajectory once its root span arrives (or `complete_after_s` after its
    last span, rootless). At most `max_traces` incomplete traces are held (the oldest is completed early) and
    `max_trajectories` finished ones wait in `trajectories()` when no `on_trajectory` takes them.
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
        max_trajectories: int = 10_000,
        complete_after_s: float = 30.0,
        limits: ConnectionLimits | None = None,
    ) -> None:
        if not api_key and not is_loopback(host):
            raise ValueError(f"an OTLP endpoint on {host!r} (beyond loopback) needs an api_key")
        self.host, self.port, self.api_key = host, port, api_key
        self.on_trajectory = on_trajectory
        self.reward, self.redact = reward, redact
        self.max_body_bytes, self.max_traces = max_body_bytes, max_traces
        self.max_trajectories, self.complete_after_s = max_trajectories, complete_after_s
        self.limits = limits or ConnectionLimits()
        self.dropped = 0  # finished trajectories no one took (the buffer was full)
        self.rejected = 0  # requests refused (bad key, Host or Origin, body, type)
        self._pending: OrderedDict[str, tuple[float, list[Span]]] = OrderedDict()
        self._done: list[Trajectory] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1/traces"

    # ---- spans -> trajectories ---------------------------------------------------------------------------------
    def add_spans(self, spans: list[Span]) -> int:
        """Take spans (as decoded); returns how many trajectories this completed."""
        ready: list[list[Span]] = []
        now = time.monotonic()
        with self._lock:
            for span in spans:
                _, members = self._pending.pop(span["trace_id"], (now, []))
                members.append(span)
                self._pending[span["trace_id"]] = (now, members)
                if span["parent_span_id"] is None:
                    ready.append(self._pending.pop(span["trace_id"])[1])
            while len(self._pending) > self.max_traces:
                ready.append(self._pending.popitem(last=False)[1][1])
            for trace_id in [
                t for t, (seen, _) in self._pending.items() if now - seen > self.complete_after_s
            ]:
                ready.append(self._pending.pop(trace_id)[1])
        return self._finish(ready)

    def flush(self) -> int:
        """Complete every pending trace now (rootless ones too)."""
        with self._lock:
            ready = [members for _, members in self._pending.values()]
            self._pending.clear()
        return self._finish(ready)

    def _finish(self, traces: list[list[Span]]) -> int:
        made = trajectories_from_spans(
            [s for members in traces for s in members], reward=self.reward, redact=self.redact
        )
        for trajectory in made:
            if self.on_trajectory is not None:
                try:
                    self.on_trajectory(trajectory)
                except Exception:  # a failing sink must not take the endpoint down
                    log.exception("on_trajectory failed for trace %s", trajectory.metadata.get("trace_id"))
                continue
            with self._lock:
                if len(self._done) >= self.max_trajectories:
                    self.dropped += 1
                else:
                    self._done.append(trajectory)
        return len(made)

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
        self.flush()

    def __enter__(self) -> OTLPEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
