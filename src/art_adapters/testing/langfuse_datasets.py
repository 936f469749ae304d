"""The dataset and experiment part of the local Langfuse API stand-in (langfuse_api.py): datasets and their items
(`/api/public/v2/datasets`, `/api/public/dataset-items`, upserts by name and id, page-numbered lists), the project
(`/api/public/projects`), and experiments (dataset runs) as Langfuse derives them from ingested spans that carry
`langfuse.experiment.*` attributes (`/api/public/experiments`, `/api/public/experiment-items`, cursor pages)."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

PROJECT = {
    "id": "project-local",
    "name": "local",
    "organization": {"id": "org-local", "name": "local"},
    "metadata": {},
}
EXPERIMENT_ATTRIBUTE = "langfuse.experiment."


def _now() -> str:
    return datetime.now(tz=UTC).isoformat().replace("+00:00", "Z")


def _when(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _page(
    rows: list[dict[str, Any]], query: dict[str, str], most: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A page-numbered slice (page from 1) and its meta, as Langfuse's v1-style lists answer."""
    page, limit = int(query.get("page", 1)), int(query.get("limit", 50))
    if page < 1 or not 1 <= limit <= most:
        raise ValueError(f"page >= 1 and limit 1..{most}")
    total = len(rows)
    meta = {"page": page, "limit": limit, "totalItems": total, "totalPages": max(1, -(-total // limit))}
    return rows[(page - 1) * limit : page * limit], meta


def _cursor_page(rows: list[dict[str, Any]], query: dict[str, str], most: int) -> dict[str, Any]:
    limit = int(query.get("limit", 50))
    if not 1 <= limit <= most:
        raise ValueError(f"limit is 1..{most}")
    start = int(base64.urlsafe_b64decode(query["cursor"]).decode()) if query.get("cursor") else 0
    meta: dict[str, Any] = {"limit": limit}
    if start + limit < len(rows):
        meta["cursor"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return {"data": rows[start : start + limit], "meta": meta}


class DatasetStore:
    """Datasets, items and experiment reads for LangfuseAPIServer; `route` answers or returns None."""

    def __init__(self) -> None:
        self.datasets: dict[str, dict[str, Any]] = {}  # name -> Dataset
        self.items: dict[str, dict[str, Any]] = {}  # id -> DatasetItem

    def route(
        self,
        method: str,
        path: str,
        query: dict[str, str],
        body: bytes,
        observations: list[dict[str, Any]],
        scores: list[dict[str, Any]],
    ) -> tuple[int, Any] | None:
        if path == "/api/public/projects" and method == "GET":
            return 200, {"data": [PROJECT]}
        if path == "/api/public/v2/datasets":
            if method == "POST":
                return 200, self._create_dataset(json.loads(body))
            rows, meta = _page(list(self.datasets.values()), query, 100)
            return 200, {"data": rows, "meta": meta}
        if path.startswith("/api/public/v2/datasets/") and method == "GET":
            name = unquote(path[len("/api/public/v2/datasets/") :])
            if name not in self.datasets:
                return 404, {"message": f"Dataset {name} not found"}
            return 200, self.datasets[name]
        if path == "/api/public/dataset-items":
            if method == "POST":
                return self._create_item(json.loads(body))
            name = query.get("datasetName")
            rows = [i for i in self.items.values() if name is None or i["datasetName"] == name]
            page, meta = _page(rows, query, 1000)
            return 200, {"data": page, "meta": meta}
        if path.startswith("/api/public/dataset-items/") and method == "GET":
            item = self.items.get(unquote(path.rsplit("/", 1)[-1]))
            return (200, item) if item else (404, {"message": "Dataset item not found"})
        if path == "/api/public/experiments" and method == "GET":
            return 200, _cursor_page(self._experiments(observations, query), query, 100)
        if path == "/api/public/experiment-items" and method == "GET":
            return 200, _cursor_page(self._experiment_items(observations, scores, query), query, 100)
        return None

    # ---- datasets --------------------------------------------------------------------------------------------
    def _create_dataset(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        if not isinstance(name, str) or not name:
            raise ValueError("dataset name must be a non-empty string")
        now = _now()
        old = self.datasets.get(name)
        dataset = {
            "id": old["id"] if old else uuid.uuid4().hex,
            "name": name,
            "description": body.get("description"),
            "metadata": body.get("metadata"),
            "inputSchema": body.get("inputSchema"),
            "expectedOutputSchema": body.get("expectedOutputSchema"),
            "projectId": PROJECT["id"],
            "createdAt": old["createdAt"] if old else now,
            "updatedAt": now,
        }
        self.datasets[name] = dataset
        return dataset

    def _create_item(self, body: dict[str, Any]) -> tuple[int, Any]:
        dataset = self.datasets.get(body["datasetName"])
        if dataset is None:
            return 404, {"message": f"Dataset {body['datasetName']} not found"}
        item_id = body.get("id") or uuid.uuid4().hex
        old = self.items.get(item_id)
        if old and old["datasetId"] != dataset["id"]:
            return 409, {"message": f"Dataset item {item_id} exists in another dataset"}
        now = _now()
        item = {
            "id": item_id,
            "status": body.get("status") or (old["status"] if old else "ACTIVE"),
            "input": body.get("input"),
            "expectedOutput": body.get("expectedOutput"),
            "metadata": body.get("metadata"),
            "sourceTraceId": body.get("sourceTraceId"),
            "sourceObservationId": body.get("sourceObservationId"),
            "datasetId": dataset["id"],
            "datasetName": dataset["name"],
            "createdAt": old["createdAt"] if old else now,
            "updatedAt": now,
            "mediaReferences": [],  # media is not stored by this stand-in
        }
        self.items[item_id] = item
        return 200, item

    # ---- experiments (dataset runs), derived from spans --------------------------------------------------------
    @staticmethod
    def _item_rows(observations: list[dict[str, Any]], query: dict[str, str]) -> list[dict[str, Any]]:
        """Each experiment item's root observation (the span the SDK names in experiment.item.root_observation_id)."""
        if "fromStartTime" not in query:
            raise ValueError("fromStartTime is required")
        low = _when(query["fromStartTime"])
        high = _when(query["toStartTime"]) if query.get("toStartTime") else float("inf")
        rows = []
        for o in observations:
            e = o.get("_experiment") or {}
            if e.get("id") and e.get("item.root_observation_id") == o["id"] and low <= o["_start"] < high:
                rows.append(o)
        return sorted(rows, key=lambda o: (-o["_start"], o["id"]))

    @staticmethod
    def _wanted(query: dict[str, str], key: str) -> set[str]:
        return set(filter(None, (query.get(key) or "").split(",")))

    def _experiments(self, observations: list[dict[str, Any]], query: dict[str, str]) -> list[dict[str, Any]]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for o in self._item_rows(observations, query):
            groups.setdefault(o["_experiment"]["id"], []).append(o)
        ids, names, datasets = (self._wanted(query, k) for k in ("id", "name", "datasetId"))
        fields = self._wanted(query, "fields")
        out = []
        for experiment_id, rows in groups.items():
            e = rows[0]["_experiment"]
            if (ids and experiment_id not in ids) or (names and e.get("name") not in names):
                continue
            if datasets and e.get("dataset.id") not in datasets:
                continue
            row = {
                "id": experiment_id,
                "name": e.get("name"),
                "description": e.get("description"),
                "startTime": min(r["startTime"] for r in rows),
                "endTime": max(r["endTime"] for r in rows),
                "itemCount": len(rows),
                "datasetId": e.get("dataset.id"),
            }
            if "metadata" in fields:
                row["metadata"] = _json(e.get("metadata"))
            out.append(row)
        return out

    def _experiment_items(
        self, observations: list[dict[str, Any]], scores: list[dict[str, Any]], query: dict[str, str]
    ) -> list[dict[str, Any]]:
        fields = self._wanted(query, "fields") or {"core", "dataset"}
        ids, names, items, datasets = (
            self._wanted(query, k)
            for k in ("experimentId", "experimentName", "experimentItemId", "datasetId")
        )
        out = []
        for o in self._item_rows(observations, query):
            e = o["_experiment"]
            if (ids and e["id"] not in ids) or (names and e.get("name") not in names):
                continue
            if (items and e.get("item.id") not in items) or (
                datasets and e.get("dataset.id") not in datasets
            ):
                continue
            row: dict[str, Any] = {
                "id": o["id"],
                "traceId": o["traceId"],
                "startTime": o["startTime"],
                "endTime": o["endTime"],
                "level": o["level"],
                "environment": o["environment"],
                "experimentId": e["id"],
                "experimentName": e.get("name"),
                "experimentItemId": e.get("item.id"),
            }
            if "dataset" in fields:
                row |= {
                    "experimentDatasetId": e.get("dataset.id"),
                    "experimentItemVersion": e.get("item.version"),
                }
            if "io" in fields:
                row |= {
                    "input": _json(o["input"]),
                    "output": _json(o["output"]),
                    "expectedOutput": _json(e.get("item.expected_output")),
                }
            if "metadata" in fields:
                row["metadata"] = {k: _json(v) for k, v in o["metadata"].items()}
            if "itemMetadata" in fields:
                row["experimentItemMetadata"] = _json(e.get("item.metadata"))
            if "experimentMetadata" in fields:
                row |= {
                    "experimentMetadata": _json(e.get("metadata")),
                    "experimentDescription": e.get("description"),
                }
            if "scores" in fields:
                row["scores"] = [
                    public_score(s)
                    for s in scores
                    if s["_traceId"] == o["traceId"] and s["_observationId"] in (None, o["id"])
                ]
            out.append(row)
        return out


def experiment_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """A span's `langfuse.experiment.*` attributes, keyed by what follows the prefix."""
    return {
        k[len(EXPERIMENT_ATTRIBUTE) :]: v for k, v in attributes.items() if k.startswith(EXPERIMENT_ATTRIBUTE)
    }


def public_score(score: dict[str, Any]) -> dict[str, Any]:
    """A stored score without the stand-in's private keys (those starting with `_`)."""
    return {k: v for k, v in score.items() if not k.startswith("_")}
