"""Reading Langfuse's public API through the SDK's client: root observations page by page, then a page's
observations and scores, each read following `meta.cursor` until it is absent, within bounds: a cursor seen before
or an empty page with a further cursor stops the read with PagingError, repeated rows are dropped, and no page
yields more rows than it asked for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from ._records import CALL_KEY, SKIPPED_CALLS_KEY, TRAJECTORY_KEY

ROOT_FIELDS = "core,basic,io,metadata,trace_context"
CHILD_FIELDS = "core,basic,io,metadata,model,usage"


MAX_PAGES = 10_000  # per read: a server handing out fresh cursors for ever is an error, not a long import


class PagingError(RuntimeError):
    """The server's pagination does not end (a cursor seen before, an empty page with a further cursor, more pages
    than any real read needs): the import stops here instead of reading or importing the same rows for ever."""


class _Cursors:
    """One read's cursors: each must be new, an empty page must be the last, and pages are bounded."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seen: set[str] = set()
        self.pages = 0

    def next(self, cursor: Any, rows: int) -> str | None:
        """The cursor to read next, None at the end; raises PagingError when pagination would not end."""
        self.pages += 1
        if not cursor:
            return None
        cursor = str(cursor)
        if rows == 0:
            raise PagingError(
                f"Langfuse {self.what}: an empty page with a further cursor {cursor[:40]!r} "
                f"(page {self.pages}); stopping instead of reading empty pages for ever"
            )
        if cursor in self.seen:
            raise PagingError(
                f"Langfuse {self.what}: cursor {cursor[:40]!r} came back again (page {self.pages}), the server "
                "would serve pages already read; stopping"
            )
        if self.pages >= MAX_PAGES:
            raise PagingError(f"Langfuse {self.what}: more than {MAX_PAGES} pages; stopping")
        self.seen.add(cursor)
        return cursor


class Reader:
    """The three reads, each following `meta.cursor` until it is absent (a cursor seen before, or an empty page
    with a further cursor, raises PagingError). Rows repeated (by id) are dropped; a page never yields more rows
    than it asked for."""

    def __init__(self, api: Any, options: dict[str, Any]) -> None:
        self.api = api
        self.options = options

    def root_pages(
        self, conditions: list[dict[str, Any]], size: int, limit: int | None
    ) -> Iterator[list[dict]]:
        cursors = _Cursors("root observations")
        cursor: str | None = None
        seen = 0
        ids: set[str] = set()
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
            data = list(page.data or [])
            rows = []
            for row in (as_row(o) for o in data[:ask]):
                key = row.get("traceId")
                if key is None or key in ids:
                    continue
                ids.add(key)
                rows.append(row)
            seen += len(rows)
            if rows:
                yield rows
            cursor = cursors.next(page.meta.cursor, len(data))
            if cursor is None:
                return

    def observations(self, trace_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        condition = [{"type": "stringOptions", "column": "traceId", "operator": "any of", "value": trace_ids}]
        wanted = set(trace_ids)
        cursors = _Cursors("child observations")
        cursor: str | None = None
        ids: set[Any] = set()
        while True:
            page = self.api.observations.get_many(
                fields=CHILD_FIELDS,
                expand_metadata=CALL_KEY,
                limit=CHILD_PAGE,
                cursor=cursor,
                filter=json.dumps(condition),
                request_options=self.options,
            )
            data = list(page.data or [])
            for observation in data[:CHILD_PAGE]:
                row = as_row(observation)
                key = (row.get("traceId"), row.get("id"))
                if key[0] not in wanted or key in ids:
                    continue
                ids.add(key)
                out.setdefault(row["traceId"], []).append(row)
            cursor = cursors.next(page.meta.cursor, len(data))
            if cursor is None:
                return out

    def scores(
        self,
        trace_ids: list[str],
        by_observation: dict[str, list[tuple[str, Any, str]]] | None = None,
    ) -> dict[str, list[tuple[str, Any, str]]]:
        """trace id -> [(name, value, data type)], oldest first. With `by_observation`, a score on an observation
        goes there instead (observation id -> its scores, oldest first), not to its trace."""
        found: dict[str, list[tuple[Any, str, Any, str]]] = {}
        on_observations: dict[str, list[tuple[Any, str, Any, str]]] = {}
        wanted = set(trace_ids)
        cursors = _Cursors("scores")
        cursor: str | None = None
        ids: set[Any] = set()
        while True:
            page = self.api.scores.get_many(
                trace_id=",".join(trace_ids),
                fields="subject",
                limit=SCORE_PAGE,
                cursor=cursor,
                request_options=self.options,
            )
            data = list(page.data or [])
            for score in data[:SCORE_PAGE]:
                subject = getattr(score, "subject", None)
                trace = getattr(subject, "id", None) if getattr(subject, "kind", "trace") == "trace" else None
                trace = trace or getattr(subject, "trace_id", None)
                key = getattr(score, "id", None)
                if key is not None:
                    if key in ids:
                        continue
                    ids.add(key)
                if trace in wanted:
                    row = (_when(getattr(score, "timestamp", None)), score.name, score.value, score.data_type)
                    observation = (
                        getattr(subject, "id", None)
                        if getattr(subject, "kind", None) == "observation"
                        else None
                    )
                    if by_observation is not None and isinstance(observation, str):
                        on_observations.setdefault(observation, []).append(row)
                    else:
                        found.setdefault(trace, []).append(row)
            cursor = cursors.next(page.meta.cursor, len(data))
            if cursor is None:
                break
        if by_observation is not None:
            for o, rows in on_observations.items():
                by_observation[o] = [(n, v, d) for _, n, v, d in sorted(rows, key=lambda r: r[0])]
        return {
            t: [(n, v, d) for _, n, v, d in sorted(rows, key=lambda r: r[0])] for t, rows in found.items()
        }


CHILD_PAGE = 1000
SCORE_PAGE = 100


def _when(value: Any) -> float:
    """A score's timestamp as a number to order by (missing or unreadable: first)."""
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return float("-inf")


def as_row(observation: Any) -> dict[str, Any]:
    data = observation.dict(by_alias=True) if hasattr(observation, "dict") else dict(observation)
    for key in ("startTime", "endTime"):
        value = data.get(key)
        if isinstance(value, datetime):
            data[key] = value.timestamp()
    return data
