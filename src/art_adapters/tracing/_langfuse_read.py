"""Reading Langfuse's public API through the SDK's client: root observations page by page, then a page's
observations and scores, each read following `meta.cursor` until it is absent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from ._records import CALL_KEY, SKIPPED_CALLS_KEY, TRAJECTORY_KEY

ROOT_FIELDS = "core,basic,io,metadata,trace_context"
CHILD_FIELDS = "core,basic,io,metadata,model,usage"


class Reader:
    """The three reads, each following `meta.cursor` until it is absent."""

    def __init__(self, api: Any, options: dict[str, Any]) -> None:
        self.api = api
        self.options = options

    def root_pages(
        self, conditions: list[dict[str, Any]], size: int, limit: int | None
    ) -> Iterator[list[dict]]:
        cursor: str | None = None
        seen = 0
        while limit is None or seen < limit:
            ask = size if limit is None else min(size, limit - seen)
            page = self.api.observations.get_many(
                fields=ROOT_FIELDS,
                expand_metadata=f"{TRAJECTORY_KEY},{SKIPPED_CALLS_KEY}",
                limit=ask,
                cursor=cursor,
                filter=json.dumps(conditions),
                request_options=self.options,
            )
            rows = [as_row(o) for o in page.data]
            seen += len(rows)
            if rows:
                yield rows
            cursor = page.meta.cursor
            if not cursor:
                return

    def observations(self, trace_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        condition = [{"type": "stringOptions", "column": "traceId", "operator": "any of", "value": trace_ids}]
        cursor: str | None = None
        while True:
            page = self.api.observations.get_many(
                fields=CHILD_FIELDS,
                expand_metadata=CALL_KEY,
                limit=1000,
                cursor=cursor,
                filter=json.dumps(condition),
                request_options=self.options,
            )
            for observation in page.data:
                row = as_row(observation)
                out.setdefault(row["traceId"], []).append(row)
            cursor = page.meta.cursor
            if not cursor:
                return out

    def scores(self, trace_ids: list[str]) -> dict[str, list[tuple[str, Any, str]]]:
        """trace id -> [(name, value, data type)], oldest first."""
        found: dict[str, list[tuple[Any, str, Any, str]]] = {}
        cursor: str | None = None
        while True:
            page = self.api.scores.get_many(
                trace_id=",".join(trace_ids),
                fields="subject",
                limit=100,
                cursor=cursor,
                request_options=self.options,
            )
            for score in page.data:
                subject = getattr(score, "subject", None)
                trace = getattr(subject, "id", None) if getattr(subject, "kind", "trace") == "trace" else None
                trace = trace or getattr(subject, "trace_id", None)
                if trace:
                    found.setdefault(trace, []).append(
                        (score.timestamp, score.name, score.value, score.data_type)
                    )
            cursor = page.meta.cursor
            if not cursor:
                break
        return {
            t: [(n, v, d) for _, n, v, d in sorted(rows, key=lambda r: r[0])] for t, rows in found.items()
        }


def as_row(observation: Any) -> dict[str, Any]:
    data = observation.dict(by_alias=True) if hasattr(observation, "dict") else dict(observation)
    for key in ("startTime", "endTime"):
        value = data.get(key)
        if isinstance(value, datetime):
            data[key] = value.timestamp()
    return data
