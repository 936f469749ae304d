"""Hostile Langfuse data through the real `langfuse` SDK client and the local server speaking Langfuse's public API
(art_adapters.testing.langfuse_api): pagination that would never end, pages served twice, a server ignoring
`limit`, an own trace with a generation missing, malformed traces, scores that are no reward, and the CLI writing
what it can. Each import ends; one bad trace never costs the others."""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from typing import Any

import pytest

pytest.importorskip("langfuse")
pytest.importorskip("opentelemetry.proto")

import art_adapters.testing.langfuse_api as langfuse_api  # noqa: E402
from art_adapters.testing.langfuse_api import LangfuseAPIServer  # noqa: E402
from art_adapters.tracing._foreign import Rewarder  # noqa: E402
from art_adapters.tracing._langfuse_read import PagingError  # noqa: E402
from art_adapters.tracing.import_cli import import_command  # noqa: E402
from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories  # noqa: E402
from art_adapters.trajectories import read_jsonl  # noqa: E402
from test_langfuse import tool_trajectory  # noqa: E402

PAGE = 7  # the root page size these tests ask for (children pages ask 1000, scores pages 100)


@pytest.fixture
def langfuse():
    public, secret = f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


def _row(trace: str, oid: str, *, root: bool, start: float, **fields: Any) -> dict[str, Any]:
    """An observation as the server's read model holds it (what ingestion would have stored)."""
    when = langfuse_api._iso(int(start * 1e9))
    row = {
        "id": oid,
        "traceId": trace,
        "projectId": "project-local",
        "startTime": when,
        "endTime": when,
        "_start": start,
        "parentObservationId": None if root else f"root-{trace}",
        "type": "SPAN" if root else "GENERATION",
        "isRootObservation": root,
        "name": "agent" if root else "OpenAI-generation",
        "level": "DEFAULT",
        "statusMessage": None,
        "environment": "default",
        "input": json.dumps([{"role": "user", "content": f"question {trace}"}]),
        "output": json.dumps({"role": "assistant", "content": f"answer {trace}"}),
        "metadata": {},
        "model": "gpt-prod",
        "modelParameters": None,
        "usageDetails": None,
        "sessionId": None,
        "userId": None,
        "traceName": "support",
        "tags": [],
        "_trace": {},
    }
    row.update(fields)
    return row


def add_trace(
    server: LangfuseAPIServer,
    trace: str,
    start: float,
    reward: float | None = 1.0,
    root: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
) -> None:
    server.observations += [
        _row(trace, f"root-{trace}", root=True, start=start, **(root or {})),
        _row(trace, f"gen-{trace}", root=False, start=start + 0.1, **(generation or {})),
    ]
    if reward is not None:
        server._add_score({"name": "reward", "value": reward, "traceId": trace})


def read(server: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("page_size", PAGE)
    return import_trajectories(
        server.public_key, server.secret_key, server.base_url, progress=False, timeout_s=10, **kwargs
    )


def _cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(str(offset).encode()).decode()


# ---- pagination ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("read_limit", [PAGE, 1000, 100], ids=["roots", "children", "scores"])
def test_a_cursor_pointing_back_stops_the_import(
    langfuse: LangfuseAPIServer, monkeypatch: pytest.MonkeyPatch, read_limit: int
) -> None:
    for i in range(3):
        add_trace(langfuse, f"t{i}", 1000.0 + i)
    real = langfuse_api._meta

    def looping(start: int, limit: int, total: int) -> dict[str, Any]:  # this read's cursor: the first page
        return {"limit": limit, "cursor": _cursor(0)} if limit == read_limit else real(start, limit, total)

    monkeypatch.setattr(langfuse_api, "_meta", looping)
    with pytest.raises(PagingError, match="came back again"):
        read(langfuse).to_list()
    assert len(langfuse.requests) < 20  # it stopped at the repeat, not at some timeout


def test_empty_pages_with_a_further_cursor_stop_the_import(
    langfuse: LangfuseAPIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_trace(langfuse, "t0", 1000.0)
    monkeypatch.setattr(  # always a next cursor, past the end too: empty pages for ever
        langfuse_api, "_meta", lambda start, limit, total: {"limit": limit, "cursor": _cursor(start + limit)}
    )
    with pytest.raises(PagingError, match="empty page"):
        read(langfuse, limit=5).to_list()


def test_pages_that_overlap_import_each_trace_once(
    langfuse: LangfuseAPIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(10):
        add_trace(langfuse, f"t{i}", 1000.0 + i)
    real = langfuse_api._meta

    def overlapping(start: int, limit: int, total: int) -> dict[str, Any]:  # each page repeats 3 rows
        meta = real(start, limit, total)
        if "cursor" in meta and limit == PAGE:
            meta["cursor"] = _cursor(start + limit - 3)
        return meta

    monkeypatch.setattr(langfuse_api, "_meta", overlapping)
    imported = read(langfuse)
    ids = [t.metadata["trace_id"] for t in imported]
    assert sorted(ids) == [f"t{i}" for i in range(10)]
    assert imported.stats.traces == 10 and imported.stats.imported == 10


def test_a_server_answering_more_rows_than_asked_is_cut_at_the_limit(
    langfuse: LangfuseAPIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(20):
        add_trace(langfuse, f"t{i}", 1000.0 + i)
    real = LangfuseAPIServer._observations
    monkeypatch.setattr(  # ignores the limit asked for, answers up to 1000 rows
        LangfuseAPIServer, "_observations", lambda self, query: real(self, {**query, "limit": "1000"})
    )
    imported = read(langfuse, limit=3)
    assert len(imported.to_list()) == 3
    assert imported.stats.traces == 3


# ---- an own trace missing a generation -------------------------------------------------------------------------


def test_an_own_trace_missing_a_generation_is_damaged_never_an_empty_answer(
    langfuse: LangfuseAPIServer,
) -> None:
    trajectory = tool_trajectory(time.time() - 30, 1.0)
    assert len(trajectory.llm_calls) == 2
    exporter = LangfuseExporter(langfuse.public_key, langfuse.secret_key, langfuse.base_url)
    (trace_id,) = exporter.export([trajectory], step=3)
    assert exporter.flush(20)
    exporter.close()
    assert langfuse.wait_for(1, scores=1)
    whole = read(langfuse).to_list()
    assert len(whole) == 1 and whole[0].metadata["trace_source"] == "art_adapters"

    generations = sorted(
        (r for r in langfuse.observations if r["type"] == "GENERATION"), key=lambda r: r["_start"]
    )
    langfuse.observations.remove(generations[-1])  # the final answer's generation not (yet) readable
    imported = read(langfuse)
    (back,) = imported.to_list()
    assert imported.stats.own == 0 and imported.stats.damaged_records == 1
    assert back.metadata["sampled_token_ids"] is False and back.metadata["damaged_record"] is True
    assert len(back.llm_calls) == 1 and back.llm_calls[0].completion_token_ids is None
    assert all(
        m.get("content") or m.get("tool_calls") for m in back.messages() if m["role"] == "assistant"
    ), "no assistant turn the model never produced"
    assert back.reward == 1.0  # the exporter's reward score


# ---- one malformed trace among good ones -----------------------------------------------------------------------

_OWN = {"metadata": {"art_trajectory": json.dumps({"v": 1, "n": 1})}}
HOSTILE = {
    "tool_calls a string": {
        "generation": {"output": json.dumps({"role": "assistant", "content": "", "tool_calls": "oops"})}
    },
    "tool_calls ints": {"generation": {"output": json.dumps({"role": "assistant", "tool_calls": [1, 2]})}},
    "parts not objects": {"generation": {"input": json.dumps([{"role": "user", "parts": ["x", 3]}])}},
    "generations a list of dicts": {"generation": {"output": json.dumps({"generations": [{"text": "x"}]})}},
    "record a number": {"root": {"metadata": {"art_trajectory": 5}}},
    "record index a list": {
        "root": _OWN,
        "generation": {"metadata": {"art_training": json.dumps({"v": 1, "k": [1], "rq": {}})}},
    },
    "record fields clash": {
        "root": _OWN,
        "generation": {
            "metadata": {"art_training": json.dumps({"v": 1, "k": 0, "rq": {}, "f": {"request": 1}})}
        },
    },
    "record choices strings": {
        "root": _OWN,
        "generation": {"metadata": {"art_training": json.dumps({"v": 1, "k": 0, "rq": {}, "o": ["x"]})}},
    },
    "record call reference an int": {
        "root": {"metadata": {"art_trajectory": json.dumps({"v": 1, "n": 1, "m": [{"$call": 5}]})}},
        "generation": {"metadata": {"art_training": json.dumps({"v": 1, "k": 0, "rq": {}})}},
    },
    "record history a string": {
        "root": {"metadata": {"art_trajectory": json.dumps({"v": 1, "n": 1, "h": ["x"]})}},
        "generation": {"metadata": {"art_training": json.dumps({"v": 1, "k": 0, "rq": {}})}},
    },
    "skipped calls strings": {
        "root": {"metadata": {"art_trajectory": json.dumps({"v": 1, "n": 1}), "art_calls": json.dumps(["x"])}}
    },
    "record reward text": {
        "root": {"metadata": {"art_trajectory": json.dumps({"v": 1, "n": 0, "reward": "abc"})}}
    },
    "input nested past the recursion limit": {"generation": {"input": "[" * 100_000 + "]" * 100_000}},
    "output nested past the recursion limit": {
        "generation": {
            "output": json.dumps({"role": "assistant", "content": "x"})[:-1]
            + ', "x": '
            + "[" * 3000
            + "]" * 3000
            + "}"
        }
    },
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_one_malformed_trace_never_aborts_the_import(langfuse: LangfuseAPIServer, case: str) -> None:
    add_trace(langfuse, "good1", 1000.0)
    add_trace(langfuse, "bad", 1001.0, **HOSTILE[case])
    add_trace(langfuse, "good2", 1002.0)
    imported = read(langfuse)
    ids = {t.metadata["trace_id"] for t in imported}
    stats = imported.stats
    assert {"good1", "good2"} <= ids
    assert stats.traces == 3
    assert (
        stats.imported + stats.skipped_malformed == 3
    )  # the bad one imported (as foreign) or skipped, counted
    assert stats.own == 0


def test_a_skipped_trace_is_named_in_a_warning(
    langfuse: LangfuseAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    add_trace(langfuse, "good1", 1000.0)
    add_trace(langfuse, "bad", 1001.0, **HOSTILE["input nested past the recursion limit"])
    imported = read(langfuse)
    assert [t.metadata["trace_id"] for t in imported] == ["good1"]
    assert imported.stats.skipped_malformed == 1
    assert any("trace bad" in r.getMessage() and "RecursionError" in r.getMessage() for r in caplog.records)


# ---- scores that are no reward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_from_a_function_is_no_reward(langfuse: LangfuseAPIServer, answer: float) -> None:
    add_trace(langfuse, "t0", 1000.0)
    imported = read(langfuse, reward=lambda scores: answer)
    assert imported.to_list() == []
    assert imported.stats.skipped_no_reward == 1 and imported.stats.imported == 0
    kept = read(langfuse, reward=lambda scores: answer, missing_reward=0.25).to_list()
    assert [t.reward for t in kept] == [0.25]


def test_a_category_mapped_to_nan_is_no_reward(langfuse: LangfuseAPIServer) -> None:
    add_trace(langfuse, "t0", 1000.0, reward=None)
    langfuse._add_score({"name": "grade", "value": "good", "dataType": "CATEGORICAL", "traceId": "t0"})
    imported = read(langfuse, reward="grade", categories={"grade": {"good": math.nan}})
    assert imported.to_list() == [] and imported.stats.skipped_no_reward == 1


def test_unmapped_categories(langfuse: LangfuseAPIServer) -> None:
    add_trace(langfuse, "t0", 1000.0, reward=None)
    add_trace(langfuse, "t1", 1001.0, reward=None)
    add_trace(langfuse, "t2", 1002.0)
    for trace, grade in (("t0", "good"), ("t1", "meh")):
        langfuse._add_score({"name": "grade", "value": grade, "dataType": "CATEGORICAL", "traceId": trace})
    langfuse._add_score({"name": "tone", "value": "weird", "dataType": "CATEGORICAL", "traceId": "t2"})
    # the reward score's unmapped category: that trace has no reward; the others import
    graded = read(langfuse, reward="grade", categories={"grade": {"good": 1.0}})
    assert [t.metadata["trace_id"] for t in graded] == ["t0"]
    assert graded.stats.skipped_no_reward == 2  # t1 (unmapped) and t2 (no grade)
    # another score's unmapped category is ignored
    toned = read(langfuse, categories={"tone": {"ok": 1.0}})
    assert [(t.metadata["trace_id"], t.reward) for t in toned] == [("t2", 1.0)]


def test_a_score_without_data_type_reads_as_its_value() -> None:
    """The SDK's v3 score model refuses a missing data type; a client built otherwise may still hand one over."""
    rewarder = Rewarder()
    assert rewarder.numbers([("reward", 0.5, None), ("label", "x", None)]) == {"reward": 0.5}  # type: ignore[list-item]


# ---- the CLI ---------------------------------------------------------------------------------------------------


def test_cli_writes_a_lone_surrogate_escaped_and_prints_its_counts(
    langfuse: LangfuseAPIServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    add_trace(langfuse, "t0", 1000.0)
    cut = json.dumps([{"role": "user", "content": "cut emoji \ud83d"}])  # a client cut a string mid-character
    add_trace(langfuse, "t1", 1001.0, generation={"input": cut})
    add_trace(langfuse, "t2", 1002.0)
    out = tmp_path / "out.jsonl"
    code = import_command(
        ["--out", str(out), "--base-url", langfuse.base_url]
        + ["--public-key", langfuse.public_key, "--secret-key", langfuse.secret_key]
    )
    assert code == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["imported"] == 3 and counts["written"] == 3 and counts["surrogates_escaped"] == 1
    back = {t.metadata["trace_id"]: t for t in read_jsonl(out)}
    assert sorted(back) == ["t0", "t1", "t2"]
    assert back["t1"].messages()[0]["content"] == "cut emoji \\ud83d"


def test_cli_stops_on_a_cursor_loop_with_the_counts_so_far(
    langfuse: LangfuseAPIServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for i in range(3):
        add_trace(langfuse, f"t{i}", 1000.0 + i)
    monkeypatch.setattr(
        langfuse_api, "_meta", lambda start, limit, total: {"limit": limit, "cursor": _cursor(0)}
    )
    out = tmp_path / "out.jsonl"
    code = import_command(
        ["--out", str(out), "--base-url", langfuse.base_url]
        + ["--public-key", langfuse.public_key, "--secret-key", langfuse.secret_key]
    )
    captured = capsys.readouterr()
    assert code == 1 and "came back again" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["out"] == str(out)
