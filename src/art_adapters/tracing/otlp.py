"""OTLP trace and log export requests (OTLP/JSON files or bodies, OTLP/protobuf bodies, gzip or not) as plain span
and log dicts: ids in hex, times in ns, attributes and event attributes as Python values."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Any

Span = dict[str, Any]
LogEvent = dict[str, Any]  # a log record as a span event: trace_id, span_id, name, time_ns, attributes


class OTLPError(ValueError):
    """A body or file that is not an OTLP trace export request."""


MAX_DECODED_BYTES = 16 * 2**20  # a request's body once gunzipped: the endpoint's default body limit


class OTLPTooLarge(OTLPError):
    """A gzip body that decompresses past the limit (a gzip bomb: 16 MiB of zeros is 16 GiB unpacked)."""


def decode_request(
    body: bytes,
    content_type: str = "application/json",
    encoding: str = "",
    max_bytes: int = MAX_DECODED_BYTES,
) -> list[Span]:
    """The spans of one `ExportTraceServiceRequest` (JSON or protobuf by `content_type`). A gzip body is unpacked
    a bounded piece at a time: past `max_bytes` it raises OTLPTooLarge, before the rest is ever unpacked."""
    if encoding.lower() == "gzip" or body[:2] == b"\x1f\x8b":
        body = gunzip(body, max_bytes)
    if "protobuf" in content_type.lower():
        return spans_of(_protobuf_as_json(body), ids="base64")
    try:
        data = json.loads(body)
    except ValueError as error:
        raise OTLPError(f"not OTLP/JSON: {error}") from error
    except RecursionError as error:  # arrays or objects nested deeper than the parser goes
        raise OTLPError("not OTLP/JSON: nested too deep") from error
    return spans_of(data)


def decode_logs_request(
    body: bytes,
    content_type: str = "application/json",
    encoding: str = "",
    max_bytes: int = MAX_DECODED_BYTES,
) -> list[LogEvent]:
    """The log records of one `ExportLogsServiceRequest`, each as the span event it stands for (GenAI
    instrumentations write a call's messages as log events: `gen_ai.user.message`, `gen_ai.choice`, ...). The event
    name is the record's `eventName` (or its `event.name` attribute); a body that is an object joins its
    attributes, any other body is the attribute `content`. Bounded as `decode_request` is."""
    if encoding.lower() == "gzip" or body[:2] == b"\x1f\x8b":
        body = gunzip(body, max_bytes)
    if "protobuf" in content_type.lower():
        return logs_of(_protobuf_as_json(body, logs=True), ids="base64")
    try:
        data = json.loads(body)
    except ValueError as error:
        raise OTLPError(f"not OTLP/JSON: {error}") from error
    except RecursionError as error:
        raise OTLPError("not OTLP/JSON: nested too deep") from error
    return logs_of(data)


def logs_of(data: Any, ids: str = "hex") -> list[LogEvent]:
    """Flatten `{"resourceLogs": [...]}` into log events; OTLPError, naming the part, for anything else."""
    try:
        return _logs_of(data, ids)
    except OTLPError:
        raise
    except RecursionError as error:
        raise OTLPError("an OTLP log export request nested too deep") from error
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise OTLPError(f"not an OTLP log export request: {type(error).__name__}: {error}") from error


def _logs_of(data: Any, ids: str) -> list[LogEvent]:
    if not isinstance(data, dict) or not isinstance(data.get("resourceLogs", []), list):
        raise OTLPError("an OTLP log export request is an object with a 'resourceLogs' list")
    out: list[LogEvent] = []
    for resource_logs in data.get("resourceLogs") or []:
        for scope_logs in resource_logs.get("scopeLogs") or []:
            for record in scope_logs.get("logRecords") or []:
                if not isinstance(record, dict):
                    raise OTLPError("every OTLP log record is an object")
                attributes = attributes_of(record.get("attributes"))
                name = record.get("eventName") or attributes.get("event.name") or ""
                if not isinstance(name, str):
                    raise OTLPError(f"an OTLP log record's event name is a string, not {type(name).__name__}")
                body = value_of(record.get("body"))
                fields = body if isinstance(body, dict) else ({} if body is None else {"content": body})
                out.append(
                    {
                        "trace_id": _hex(record.get("traceId") or "", ids),
                        "span_id": _hex(record.get("spanId") or "", ids),
                        "name": name,
                        "time_ns": int(record.get("timeUnixNano") or record.get("observedTimeUnixNano") or 0),
                        "attributes": {**attributes, **fields},
                    }
                )
    return out


def gunzip(body: bytes, max_bytes: int) -> bytes:
    """`body` (one or more gzip members, as `gzip.decompress` reads) unpacked, never holding more than `max_bytes`
    + 1 of output: OTLPTooLarge past it, OTLPError for a body that is not gzip or ends early."""
    out = bytearray()
    rest = body
    while True:
        unpacker = zlib.decompressobj(wbits=31)  # gzip header and trailer, checked
        pending = rest
        while not unpacker.eof:
            try:
                piece = unpacker.decompress(pending, max_bytes - len(out) + 1)
            except zlib.error as error:
                raise OTLPError(f"gzip body does not decompress: {error}") from error
            out += piece
            if len(out) > max_bytes:
                raise OTLPTooLarge(f"gzip body decompresses to over {max_bytes} bytes")
            if not piece and len(unpacker.unconsumed_tail) == len(pending):  # no progress: the input ran out
                raise OTLPError("gzip body does not decompress: it ends before its last member does")
            pending = unpacker.unconsumed_tail
        rest = unpacker.unused_data.lstrip(b"\x00")  # zero padding between members, as gzip.decompress skips
        if not rest:
            return bytes(out)


def read_files(paths: list[str | Path]) -> list[Span]:
    """Spans of OTLP/JSON files: one export request per file, or one per line (the OTel Collector's file
    exporter writes JSON lines), with the log events of log export requests among them joined to their spans."""
    spans: list[Span] = []
    logs: list[LogEvent] = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        try:
            requests = [json.loads(text)]
            found = [_records(request) for request in requests]
        except (ValueError, RecursionError):  # not one request: one per line
            found = []
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        found.append(_records(json.loads(line)))
                    except (ValueError, RecursionError) as error:
                        raise OTLPError(f"{path} line {number}: not OTLP/JSON ({error})") from error
        for file_spans, file_logs in found:
            spans += file_spans
            logs += file_logs
    return join_logs(spans, logs)


def _records(data: Any) -> tuple[list[Span], list[LogEvent]]:
    """A trace export request's spans, a log export request's log events (a request holding both: both)."""
    logs = logs_of(data) if isinstance(data, dict) and "resourceLogs" in data else []
    return spans_of(data), logs


def join_logs(spans: list[Span], logs: list[LogEvent]) -> list[Span]:
    """The spans, each with the log events of its trace and span id appended to its own events (in order)."""
    if not logs:
        return spans
    by_span: dict[tuple[str, str], list[LogEvent]] = {}
    for event in logs:
        by_span.setdefault((event["trace_id"], event["span_id"]), []).append(event)
    out = []
    for span in spans:
        extra = by_span.get((span["trace_id"], span["span_id"]))
        out.append({**span, "events": span["events"] + extra} if extra else span)
    return out


def spans_of(data: Any, ids: str = "hex") -> list[Span]:
    """Flatten `{"resourceSpans": [...]}` into span dicts; OTLPError, naming the part, for anything else (a field of
    the wrong type, a number or id that does not parse, values nested too deep)."""
    try:
        return _spans_of(data, ids)
    except OTLPError:
        raise
    except RecursionError as error:
        raise OTLPError("an OTLP trace export request nested too deep") from error
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise OTLPError(f"not an OTLP trace export request: {type(error).__name__}: {error}") from error


def _spans_of(data: Any, ids: str) -> list[Span]:
    if not isinstance(data, dict) or not isinstance(data.get("resourceSpans", []), list):
        raise OTLPError("an OTLP trace export request is an object with a 'resourceSpans' list")
    out: list[Span] = []
    for resource_spans in data.get("resourceSpans") or []:
        resource = attributes_of((resource_spans.get("resource") or {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans") or []:
            scope = (scope_spans.get("scope") or {}).get("name", "")
            for span in scope_spans.get("spans") or []:
                if not isinstance(span, dict) or not span.get("traceId") or not span.get("spanId"):
                    raise OTLPError("every OTLP span has a traceId and a spanId")
                out.append(
                    {
                        "trace_id": _hex(span["traceId"], ids),
                        "span_id": _hex(span["spanId"], ids),
                        "parent_span_id": _hex(span.get("parentSpanId") or "", ids) or None,
                        "name": span.get("name", ""),
                        "start_ns": int(span.get("startTimeUnixNano") or 0),
                        "end_ns": int(span.get("endTimeUnixNano") or 0),
                        "attributes": attributes_of(span.get("attributes")),
                        "events": [
                            {
                                "name": e.get("name", ""),
                                "time_ns": int(e.get("timeUnixNano") or 0),
                                "attributes": attributes_of(e.get("attributes")),
                            }
                            for e in span.get("events") or []
                        ],
                        "status": (span.get("status") or {}).get("code"),
                        "scope": scope,
                        "resource": resource,
                    }
                )
    return out


def attributes_of(items: Any) -> dict[str, Any]:
    return {
        kv["key"]: value_of(kv.get("value")) for kv in items or [] if isinstance(kv, dict) and "key" in kv
    }


def value_of(value: Any) -> Any:
    """An OTLP AnyValue as a Python value (int64 comes as a string in OTLP/JSON)."""
    if not isinstance(value, dict) or not value:
        return None
    kind, inner = next(iter(value.items()))
    if kind == "intValue":
        return int(inner)
    if kind == "doubleValue":
        return float(inner)
    if kind == "arrayValue":
        return [value_of(v) for v in (inner or {}).get("values") or []]
    if kind == "kvlistValue":
        return attributes_of((inner or {}).get("values"))
    if kind == "bytesValue":
        return base64.b64decode(inner).hex()
    return inner


def _hex(value: str, ids: str) -> str:
    if not value:
        return ""
    if ids == "base64":  # protobuf bytes, as json_format writes them
        return base64.b64decode(value).hex()
    return value.lower()


def _protobuf_as_json(body: bytes, logs: bool = False) -> dict[str, Any]:
    try:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as error:
        raise OTLPError(
            "OTLP/protobuf needs `pip install opentelemetry-proto` (OTLP/JSON does not)"
        ) from error
    request: Any = ExportLogsServiceRequest() if logs else ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError
        raise OTLPError(f"not an OTLP/protobuf {type(request).__name__}: {error}") from error
    return MessageToDict(request)
