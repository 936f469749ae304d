"""A local stand-in for the parts of Langfuse's public API its Python SDK uses to write and read traces, on
127.0.0.1: OTLP ingestion and score creation in; `GET /api/public/v2/observations` (cursor pages, field groups,
metadata values over 200 characters truncated unless expanded, the query and `filter` filters) and
`GET /api/public/v3/scores` out; datasets, dataset items and experiments (dataset runs) through
langfuse_datasets.py. No Langfuse server runs offline; this one lets the importer be tested through the
real `langfuse` client.

    with LangfuseAPIServer(public_key="pk", secret_key="sk") as server:
        exporter = LangfuseExporter("pk", "sk", server.base_url) ...
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..tracing.otlp import OTLPError, decode_request
from .langfuse_datasets import DatasetStore, experiment_attributes, public_score

_META = "langfuse.observation.metadata."
_GROUPS = {"core", "basic", "time", "io", "metadata", "model", "usage", "prompt", "metrics", "trace_context"}


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat().replace("+00:00", "Z")


def _when(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class LangfuseAPIServer:
    """Real HTTP server; `observations` and `scores` hold what was ingested (as Langfuse's read model)."""

    def __init__(self, public_key: str | None = None, secret_key: str | None = None) -> None:
        self.keys = (public_key, secret_key) if public_key and secret_key else None
        self.observations: list[dict[str, Any]] = []
        self.scores: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.datasets = DatasetStore()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> LangfuseAPIServer:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(*api.handle("GET", self.path, dict(self.headers.items()), b""))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                self._answer(*api.handle("POST", self.path, dict(self.headers.items()), body))

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="langfuse-api").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> LangfuseAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def wait_for(self, traces: int, scores: int = 0, timeout_s: float = 20.0) -> bool:
        """Until `traces` root observations and `scores` scores arrived (the SDK sends in the background)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                roots = sum(1 for o in self.observations if o["isRootObservation"])
                if roots >= traces and len(self.scores) >= scores:
                    return True
            time.sleep(0.02)
        return False

    # ---- routing -----------------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        url = urlsplit(path)
        self.requests.append((method, url.path))
        lower = {k.lower(): v for k, v in headers.items()}
        if not self._authorized(lower.get("authorization", "")):
            return 401, {"message": "Invalid credentials"}
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if method == "POST" and url.path.endswith("/otel/v1/traces"):
                self._ingest(
                    decode_request(body, lower.get("content-type", ""), lower.get("content-encoding", ""))
                )
                return 200, {}
            if method == "POST" and url.path == "/api/public/scores":  # one score, or a batch
                data = json.loads(body)
                added = [self._add_score(s) for s in (data if isinstance(data, list) else [data])]
                if isinstance(data, list):
                    return 200, {"message": "Accepted"}
                return 200, added[0]
            if method == "POST" and url.path == "/api/public/ingestion":
                for event in json.loads(body).get("batch", []):
                    if event.get("type") == "score-create":
                        self._add_score(event["body"])
                return 207, {"successes": [], "errors": []}
            if method == "GET" and url.path == "/api/public/v2/observations":
                return 200, self._observations(query)
            if method == "GET" and url.path == "/api/public/v3/scores":
                return 200, self._scores(query)
            with self._lock:
                answer = self.datasets.route(method, url.path, query, body, self.observations, self.scores)
            if answer is not None:
                return answer
        except (ValueError, KeyError, OTLPError) as error:
            return 400, {"message": f"{type(error).__name__}: {error}"}
        return 404, {"message": f"{method} {url.path} is not served by this stand-in"}

    def _authorized(self, header: str) -> bool:
        if self.keys is None:
            return True
        scheme, _, token = header.partition(" ")
        try:
            return scheme.lower() == "basic" and base64.b64decode(token).decode() == ":".join(self.keys)  # type: ignore[arg-type]
        except ValueError:
            return False

    # ---- writing -----------------------------------------------------------------------------------------------
    def _ingest(self, spans: list[dict[str, Any]]) -> None:
        rows = [self._observation(span) for span in spans]
        with self._lock:
            self.observations += rows
            traces: dict[str, dict[str, Any]] = {}
            for row in self.observations:  # trace context: what any of a trace's spans set
                context = traces.setdefault(row["traceId"], {"tags": set()})
                for key in ("sessionId", "userId", "traceName"):
                    if row["_trace"].get(key) and not context.get(key):
                        context[key] = row["_trace"][key]
                context["tags"] |= set(row["_trace"].get("tags") or [])
            for row in self.observations:
                context = traces[row["traceId"]]
                row.update({k: context.get(k) for k in ("sessionId", "userId", "traceName")})
                row["tags"] = sorted(context["tags"])

    def _observation(self, span: dict[str, Any]) -> dict[str, Any]:
        a = span["attributes"]
        root = span["parent_span_id"] is None or bool(a.get("langfuse.internal.as_root"))
        tags = a.get("langfuse.trace.tags")
        return {
            "id": span["span_id"],
            "traceId": span["trace_id"],
            "projectId": "project-local",
            "startTime": _iso(span["start_ns"]),
            "endTime": _iso(span["end_ns"]),
            "_start": span["start_ns"] / 1e9,
            "parentObservationId": span["parent_span_id"],
            "type": str(a.get("langfuse.observation.type") or "span").upper(),
            "isRootObservation": root,
            "name": span["name"],
            "level": a.get("langfuse.observation.level") or "DEFAULT",
            "statusMessage": a.get("langfuse.observation.status_message"),
            "environment": a.get("langfuse.environment")
            or span["resource"].get("deployment.environment")
            or "default",
            "input": a.get("langfuse.observation.input"),
            "output": a.get("langfuse.observation.output"),
            "metadata": {k[len(_META) :]: v for k, v in a.items() if k.startswith(_META)},
            "model": a.get("langfuse.observation.model.name"),
            "modelParameters": _json(a.get("langfuse.observation.model.parameters")),
            "usageDetails": _counts(_json(a.get("langfuse.observation.usage_details"))),
            "_experiment": experiment_attributes(a),
            "_trace": {
                "sessionId": a.get("session.id"),
                "userId": a.get("user.id"),
                "traceName": a.get("langfuse.trace.name"),
                "tags": list(tags) if isinstance(tags, list | tuple) else [],
            },
        }

    def _add_score(self, body: dict[str, Any]) -> dict[str, Any]:
        data_type = str(
            body.get("dataType") or ("CATEGORICAL" if isinstance(body["value"], str) else "NUMERIC")
        )
        value = body["value"]
        if data_type == "BOOLEAN":
            value = bool(value)
        elif data_type == "NUMERIC":
            value = float(value)
        score = {
            "id": body.get("id") or uuid.uuid4().hex,
            "projectId": "project-local",
            "name": body["name"],
            "value": value,
            "dataType": data_type,
            "source": "API",
            "timestamp": body.get("timestamp") or _iso(time.time_ns()),
            "environment": body.get("environment") or "default",
            "createdAt": _iso(time.time_ns()),
            "updatedAt": _iso(time.time_ns()),
            "comment": body.get("comment"),
            "metadata": body.get("metadata"),
            "subject": {"kind": "observation", "id": body["observationId"], "traceId": body["traceId"]}
            if body.get("observationId")
            else {"kind": "trace", "id": body["traceId"]},
            "_traceId": body["traceId"],
            "_observationId": body.get("observationId"),
        }
        with self._lock:
            self.scores = [s for s in self.scores if s["id"] != score["id"]] + [score]
        return {"id": score["id"]}

    # ---- reading -----------------------------------------------------------------------------------------------
    def _observations(self, query: dict[str, str]) -> dict[str, Any]:
        limit = int(query.get("limit", 50))
        if not 1 <= limit <= 1000:
            raise ValueError("limit is 1..1000")
        groups = set((query.get("fields") or "core,basic").split(",")) | {"core"}
        if groups - _GROUPS:
            raise ValueError(f"unknown field groups {sorted(groups - _GROUPS)}")
        expand = set(filter(None, (query.get("expandMetadata") or "").split(",")))
        with self._lock:
            rows = [r for r in self.observations if self._matches(r, query)]
        rows.sort(key=lambda r: (-r["_start"], r["id"]))
        start = int(base64.urlsafe_b64decode(query["cursor"]).decode()) if query.get("cursor") else 0
        page = rows[start : start + limit]
        return {"data": [self._view(r, groups, expand) for r in page], "meta": _meta(start, limit, len(rows))}

    def _matches(self, row: dict[str, Any], query: dict[str, str]) -> bool:
        simple = {"name": "name", "userId": "userId", "sessionId": "sessionId", "traceId": "traceId"}
        for param, column in simple.items():
            if param in query and row.get(column) != query[param]:
                return False
        if "type" in query and row["type"] != query["type"].upper():
            return False
        if "isRootObservation" in query and row["isRootObservation"] != (
            query["isRootObservation"] == "true"
        ):
            return False
        if "fromStartTime" in query and row["_start"] < _when(query["fromStartTime"]):
            return False
        if "toStartTime" in query and row["_start"] >= _when(query["toStartTime"]):
            return False
        return all(_condition(row, c) for c in json.loads(query.get("filter") or "[]"))

    @staticmethod
    def _view(row: dict[str, Any], groups: set[str], expand: set[str]) -> dict[str, Any]:
        keys = ["id", "traceId", "startTime", "endTime", "projectId", "parentObservationId", "type"]
        if "basic" in groups:
            keys += [
                "name",
                "level",
                "statusMessage",
                "environment",
                "userId",
                "sessionId",
                "isRootObservation",
            ]
        if "io" in groups:
            keys += ["input", "output"]
        if "model" in groups:
            keys += ["model", "modelParameters"]
        if "usage" in groups:
            keys += ["usageDetails"]
        if "trace_context" in groups:
            keys += ["tags", "traceName"]
        out = {k: row.get(k) for k in keys}
        if "metadata" in groups:
            out["metadata"] = {
                k: v if k in expand or not isinstance(v, str) or len(v) <= 200 else v[:200]
                for k, v in row["metadata"].items()
            }
        return out

    def _scores(self, query: dict[str, str]) -> dict[str, Any]:
        limit = int(query.get("limit", 50))
        if not 1 <= limit <= 100:
            raise ValueError("limit is 1..100 (a larger one is HTTP 400)")
        traces = set(filter(None, (query.get("traceId") or "").split(",")))
        names = set(filter(None, (query.get("name") or "").split(",")))
        with self._lock:
            rows = [
                s
                for s in self.scores
                if (not traces or s["_traceId"] in traces) and (not names or s["name"] in names)
            ]
        start = int(base64.urlsafe_b64decode(query["cursor"]).decode()) if query.get("cursor") else 0
        fields = set((query.get("fields") or "").split(","))
        page = [
            {k: v for k, v in public_score(s).items() if k != "subject" or "subject" in fields}
            for s in rows[start : start + limit]
        ]
        return {"data": page, "meta": _meta(start, limit, len(rows))}


def _meta(start: int, limit: int, total: int) -> dict[str, Any]:
    """Cursor pages' meta: the cursor (an offset, opaque to clients) until the last page."""
    meta: dict[str, Any] = {"limit": limit}
    if start + limit < total:
        meta["cursor"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return meta


def _counts(usage: Any) -> dict[str, int] | None:
    """Usage as Langfuse keeps it: token counts by name (nested details and empty values dropped)."""
    if not isinstance(usage, dict):
        return None
    return {k: int(v) for k, v in usage.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _condition(row: dict[str, Any], condition: dict[str, Any]) -> bool:
    """One of Langfuse's filter conditions on a row (the columns and operators the importer uses)."""
    column, op, value = condition["column"], condition["operator"], condition.get("value")
    if column in ("tags", "traceTags"):
        tags = set(row.get("tags") or [])
        if op == "any of":
            return bool(tags & set(value))
        if op == "all of":
            return set(value) <= tags
        if op == "none of":
            return not tags & set(value)
    elif column in ("traceId", "sessionId", "userId", "name", "traceName", "type", "id"):
        field = row.get(column)
        if op == "=":
            return field == value
        if op == "any of":
            return field in value
        if op == "none of":
            return field not in value
    elif column == "startTime":
        t, v = row["_start"], _when(value)
        return {">": t > v, ">=": t >= v, "<": t < v, "<=": t <= v}[op]
    elif column == "isRootObservation" and op == "=":
        return row["isRootObservation"] == bool(value)
    raise ValueError(f"filter on {column!r} with {op!r} is not supported by this stand-in")
