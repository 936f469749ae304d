"""A fake Langfuse server on 127.0.0.1: decodes the SDK's OTLP protobuf traces and JSON scores for asserts.

Modes: `ok` (answers 200), `error500` (answers 500 to everything), `hang` (reads the request, never answers).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    """Flatten an ExportTraceServiceRequest into plain span dicts (ids as hex, times in ns)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[dict[str, Any]] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex() or None,
                        "name": span.name,
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                        "scope": scope_spans.scope.name,
                        "resource": resource,
                    }
                )
    return spans


class LangfuseReceiver:
    """Real HTTP server standing in for Langfuse; `spans`, `scores` and `requests` keep what arrived."""

    def __init__(self, mode: str = "ok") -> None:
        if mode not in ("ok", "error500", "hang"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.spans: list[dict[str, Any]] = []
        self.scores: list[dict[str, Any]] = []
        self.other: list[tuple[str, Any]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, lower-cased headers
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> LangfuseReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                receiver._record(method, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                if method == "GET" and receiver.mode == "ok":
                    found = receiver.trace_view(self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1])
                    payload = json.dumps(found or {"message": "trace not found"}).encode()
                    self.send_response(200 if found else 404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if receiver.mode == "hang":
                    receiver._release.wait()
                    return
                status = 500 if receiver.mode == "error500" else 200
                payload = json.dumps({"status": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> LangfuseReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "receiver not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- recording ------------------------------------------------------------------------------------------
    def _record(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        with self._lock:
            self.requests.append((method, path, headers))
            route = path.split("?")[0]
            if route.endswith("/otel/v1/traces"):
                self.spans.extend(decode_spans(body))
            elif route.endswith("/api/public/scores"):
                data = json.loads(body)
                self.scores.extend(data if isinstance(data, list) else [data])
            elif route.endswith("/api/public/ingestion"):
                for event in json.loads(body).get("batch", []):
                    if event.get("type") == "score-create":
                        self.scores.append(event["body"])
                    else:
                        self.other.append((route, event))
            else:
                self.other.append((route, body.decode(errors="replace")))

    # -- queries --------------------------------------------------------------------------------------------
    def traces(self) -> dict[str, list[dict[str, Any]]]:
        """Spans grouped by trace id."""
        out: dict[str, list[dict[str, Any]]] = {}
        with self._lock:
            for span in self.spans:
                out.setdefault(span["trace_id"], []).append(span)
        return out

    def observations(self, trace_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        spans = self.traces().get(trace_id, [])
        return [s for s in spans if kind is None or s["attributes"].get("langfuse.observation.type") == kind]

    def scores_of(self, trace_id: str) -> dict[str, float]:
        with self._lock:
            return {s["name"]: s["value"] for s in self.scores if s.get("traceId") == trace_id}

    def trace_view(self, trace_id: str) -> dict[str, Any] | None:
        """A small stand-in for Langfuse's `GET /api/public/traces/{id}` (the fields check_roundtrip.py reads)."""
        spans = self.traces().get(trace_id)
        if not spans:
            return None
        first = spans[0]["attributes"]
        return {
            "id": trace_id,
            "sessionId": first.get("session.id"),
            "tags": first.get("langfuse.trace.tags") or [],
            "observations": [
                {
                    "id": s["span_id"],
                    "type": str(s["attributes"].get("langfuse.observation.type", "span")).upper(),
                    "name": s["name"],
                    "model": s["attributes"].get("langfuse.observation.model.name"),
                    "startTime": s["start_ns"] / 1e9,
                    "endTime": s["end_ns"] / 1e9,
                }
                for s in spans
            ],
            "scores": [{"name": n, "value": v} for n, v in self.scores_of(trace_id).items()],
        }

    def wait_for(self, predicate: Callable[[LangfuseReceiver], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.02)
        return predicate(self)


def attr_json(span: dict[str, Any], key: str) -> Any:
    """A Langfuse attribute the SDK JSON-encoded (input, output, usage, ...), decoded."""
    value = span["attributes"].get(key)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
