"""Langfuse traces back into Trajectories, through the SDK's own client (`GET /api/public/v2/observations`, cursor
pages; `GET /api/public/v3/scores`), one page of traces in memory at a time.

Our own traces (written by `LangfuseExporter`, training data on) come back as the Trajectories they were: token
ids, logprobs, policy versions, served models, sources, histories and reward. Any other trace (Langfuse's
`langfuse.openai` wrapper, its LangChain `CallbackHandler`, anything else with generations) becomes a Trajectory of
chat calls without sampled token ids, flagged `metadata["sampled_token_ids"] = False`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from ..redaction import Redactor, apply, drop_secrets
from ..trajectories import LLMCall, Trajectory, check_missing_reward, reward_missing
from ._foreign import (
    Rewarder,
    RewardFn,
    answer_message,
    chat_messages,
    foreign_call,
    foreign_trajectory,
    parsed,
)
from ._langfuse_read import Reader
from ._records import (
    CALL_KEY,
    SKIPPED_CALLS_KEY,
    TRAJECTORY_KEY,
    RecordError,
    unpack_call,
    unpack_trajectory,
)

log = logging.getLogger(__name__)


class ImportStats(BaseModel):
    """What an import read and what it did with it."""

    pages: int = 0
    traces: int = 0
    imported: int = 0
    own: int = 0  # traces we wrote, back with their token ids
    foreign: int = 0  # traces without training records: no sampled token ids
    damaged_records: int = (
        0  # own traces whose records did not read back, or missing calls (imported as foreign)
    )
    skipped_malformed: int = 0  # traces that could not be converted at all (warned with their ids)
    skipped_no_reward: int = 0
    skipped_by_score: int = 0
    skipped_no_calls: int = 0
    skipped_by_redaction: int = 0


class TraceImport:
    """An iterable of the imported Trajectories (streamed page by page; iterate once) and its `stats`."""

    def __init__(self, pages: Iterator[Trajectory], stats: ImportStats) -> None:
        self._items = pages
        self.stats = stats

    def __iter__(self) -> Iterator[Trajectory]:
        return self._items

    def to_list(self) -> list[Trajectory]:
        return list(self._items)


def import_trajectories(
    public_key: str | None = None,
    secret_key: str | None = None,
    base_url: str | None = None,
    *,
    name: str | None = None,
    tags: list[str] | None = None,
    session_id: str | None = None,
    user_id: str | None = None,
    from_time: datetime | None = None,
    to_time: datetime | None = None,
    reward: str | RewardFn | None = "reward",
    categories: Mapping[str, Mapping[str, float]] | None = None,
    min_scores: Mapping[str, float] | None = None,
    missing_reward: float | None = None,
    limit: int | None = None,
    page_size: int = 100,
    redact: Redactor | None = drop_secrets,
    progress: bool = True,
    timeout_s: float = 60.0,
    client: Any = None,
) -> TraceImport:
    """Read traces from Langfuse as Trajectories (streamed: at most `page_size` traces in memory at once).

    Selects traces by trace `name`, `tags` (all of them), `session_id`, `user_id` and start time in
    [`from_time`, `to_time`). Scores become the reward: the score named `reward` (default "reward", which the
    exporter writes), or `reward(scores)` combining several (scores as numbers: numeric as is, boolean 1/0,
    categorical through `categories[name][category]`); an own trace with no such score keeps its recorded reward,
    any other gets `missing_reward` or is skipped (counted). `min_scores` keeps only traces whose named scores
    are at least the given values. `redact` runs on each trajectory before it is yielded (default: API keys and
    Authorization headers dropped; None keeps everything). Keys and URL fall back to LANGFUSE_PUBLIC_KEY,
    LANGFUSE_SECRET_KEY and LANGFUSE_BASE_URL / LANGFUSE_HOST; `client` may be a ready `langfuse.Langfuse`.
    """
    check_missing_reward(missing_reward)
    if not 1 <= page_size <= 100:
        raise ValueError(f"page_size is 1..100 (Langfuse's score API pages at most 100), not {page_size}")
    if client is None:
        client = _client(public_key, secret_key, base_url, timeout_s)
    stats = ImportStats()
    rewarder = Rewarder(reward, categories)
    conditions = _filter(name, tags, session_id, user_id, from_time, to_time)
    reader = Reader(client.api, {"timeout_in_seconds": timeout_s, "max_retries": 2})

    def trajectories() -> Iterator[Trajectory]:
        bar = _progress(progress, limit)
        try:
            for roots in reader.root_pages(conditions, page_size, limit):
                stats.pages += 1
                ids = [r["traceId"] for r in roots]
                children = reader.observations(ids)
                on_observations: dict[str, list[tuple[str, Any, str]]] = {}
                scores = reader.scores(ids, on_observations)
                for root in roots:
                    stats.traces += 1
                    trace_id = root["traceId"]
                    try:  # one trace's conversion: whatever it raises skips that trace only
                        kept = _convert(
                            root,
                            children.get(trace_id, []),
                            scores.get(trace_id, []),
                            on_observations,
                            rewarder,
                            stats,
                            min_scores,
                            missing_reward,
                            redact,
                        )
                    except Exception as error:  # noqa: BLE001 - isolation is the point (RecursionError too)
                        stats.skipped_malformed += 1
                        log.warning(
                            "trace %s: skipped, it could not be converted (%s: %s)",
                            trace_id,
                            type(error).__name__,
                            _oneline(error),
                        )
                        kept = None
                    if kept is not None:
                        stats.imported += 1
                        yield kept
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    return TraceImport(trajectories(), stats)


# ---- reading ---------------------------------------------------------------------------------------------------


def _filter(
    name: str | None,
    tags: list[str] | None,
    session_id: str | None,
    user_id: str | None,
    from_time: datetime | None,
    to_time: datetime | None,
) -> list[dict[str, Any]]:
    """One `filter` (it takes precedence over the query's filters, so everything goes in it)."""
    out: list[dict[str, Any]] = [
        {"type": "boolean", "column": "isRootObservation", "operator": "=", "value": True}
    ]
    for column, value in (("traceName", name), ("sessionId", session_id), ("userId", user_id)):
        if value is not None:
            out.append({"type": "string", "column": column, "operator": "=", "value": value})
    if tags:
        out.append({"type": "arrayOptions", "column": "tags", "operator": "all of", "value": list(tags)})
    for operator, when in ((">=", from_time), ("<", to_time)):
        if when is not None:
            out.append(
                {"type": "datetime", "column": "startTime", "operator": operator, "value": when.isoformat()}
            )
    return out


# ---- building --------------------------------------------------------------------------------------------------


def _convert(
    root: dict[str, Any],
    observations: list[dict[str, Any]],
    scores: list[tuple[str, Any, str]],
    on_observations: Mapping[str, list[tuple[str, Any, str]]],
    rewarder: Rewarder,
    stats: ImportStats,
    min_scores: Mapping[str, float] | None,
    missing: float | None,
    redact: Redactor | None,
) -> Trajectory | None:
    """One trace as the Trajectory to yield, or None (skipped, counted). In a trace of several calls, the reward
    score (named, not a function's) on a generation is that call's reward; any other observation's scores, and
    every score of a one-call trace, are the trace's."""
    generations: dict[str, LLMCall] = {}
    trajectory = _build(root, observations, stats, generations)
    if trajectory is None:
        stats.skipped_no_calls += 1
        return None
    per_call = len(trajectory.llm_calls) > 1 and isinstance(rewarder.reward, str)
    own_scores = []
    for observation in observations:
        rows = on_observations.get(str(observation.get("id")), [])
        call = generations.get(str(observation.get("id")))
        if per_call and call is not None:
            value = rewarder(rewarder.numbers(rows)) if rows else None
            if value is not None:
                call.reward = value
        else:
            own_scores += rows
    scores = [*own_scores, *scores]  # the trace's own scores last: they win a name both have
    if not _rewarded(trajectory, scores, rewarder, stats, min_scores, missing):
        return None
    kept = apply(redact, trajectory)
    if kept is None:
        stats.skipped_by_redaction += 1
    return kept


def _oneline(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def _metadata(row: dict[str, Any]) -> dict[str, Any]:
    """An observation's metadata as an object (absent, null, or not an object: empty)."""
    value = parsed(row.get("metadata"))
    return value if isinstance(value, dict) else {}


def _build(
    root: dict[str, Any],
    observations: list[dict[str, Any]],
    stats: ImportStats,
    call_of: dict[str, LLMCall],
) -> Trajectory | None:
    """The trace's Trajectory (None: no generation); `call_of` gets each generation's id -> its call."""
    metadata = _metadata(root)
    damaged = False
    if TRAJECTORY_KEY in metadata:
        try:
            trajectory = _own(root, metadata, observations, call_of)
            stats.own += 1
            return trajectory
        except Exception as error:  # noqa: BLE001 - a record of any damaged shape (RecursionError too)
            damaged = True
            stats.damaged_records += 1
            log.warning(
                "trace %s: its training record does not read back (%s: %s); imported without token ids",
                root["traceId"],
                type(error).__name__,
                _oneline(error),
            )
    generations = [o for o in observations if o.get("type") == "GENERATION"]
    if not generations:
        return None
    calls = [_foreign_call(g) for g in generations]
    call_of.clear()
    call_of.update({str(g.get("id")): c for g, c in zip(generations, calls, strict=True)})
    stats.foreign += 1
    trajectory = foreign_trajectory(
        calls,
        source=_tracer(observations),
        trace_id=root["traceId"],
        metadata={
            "trace_name": root.get("traceName"),
            "session_id": root.get("sessionId"),
            "user_id": root.get("userId"),
        },
    )
    if damaged:
        trajectory.metadata["damaged_record"] = True
    return trajectory


def _own(
    root: dict[str, Any],
    metadata: dict[str, Any],
    observations: list[dict[str, Any]],
    generations: dict[str, LLMCall],
) -> Trajectory:
    """The trace as the Trajectory it was; RecordError when any call of its record is missing or damaged."""
    calls: dict[int, LLMCall] = {}
    mismatched = 0
    entries = [(_metadata(o).get(CALL_KEY), parsed(o.get("input"))) for o in observations]
    observation_ids: list[str | None] = [str(o.get("id")) for o in observations]
    skipped = metadata.get(SKIPPED_CALLS_KEY)
    if skipped:
        skipped = parsed(skipped) if isinstance(skipped, str) else skipped
        if not isinstance(skipped, list) or not all(isinstance(e, dict) for e in skipped):
            raise RecordError(f"{SKIPPED_CALLS_KEY} is not a list of records")
        entries += [(e.get("record"), e.get("messages")) for e in skipped]
        observation_ids += [None] * len(skipped)
    by_index: dict[str, int] = {}
    for (record, messages), observation in zip(entries, observation_ids, strict=True):
        if record is None:
            continue
        index, call, matched = unpack_call(record, messages)
        calls.setdefault(index, call)
        if observation is not None:
            by_index[observation] = index
        mismatched += not matched
    trajectory = unpack_trajectory(metadata[TRAJECTORY_KEY], calls)
    generations.update({o: calls[i] for o, i in by_index.items()})
    trajectory.metadata.setdefault("trace_id", root["traceId"])
    trajectory.metadata["trace_source"] = "art_adapters"
    if mismatched:  # masked or truncated inputs: the messages are not the ones sampled from
        trajectory.metadata["messages_mismatch"] = mismatched
        log.warning(
            "trace %s: %d generations' inputs differ from what was sent (masked?)",
            root["traceId"],
            mismatched,
        )
    return trajectory


def _foreign_call(generation: dict[str, Any]) -> LLMCall:
    messages = chat_messages(generation.get("input")) or []
    start = _seconds(generation.get("startTime"), "startTime") or 0.0
    usage = generation.get("usageDetails")
    return foreign_call(
        messages,
        answer_message(generation.get("output")),
        model=generation.get("model") if isinstance(generation.get("model"), str) else None,
        started_at=start,
        ended_at=_seconds(generation.get("endTime"), "endTime") or start,
        parameters=generation.get("modelParameters")
        if isinstance(generation.get("modelParameters"), dict)
        else None,
        usage=usage if isinstance(usage, dict) else None,
        error=generation.get("statusMessage") if generation.get("level") == "ERROR" else None,
    )


def _seconds(value: Any, field: str) -> float | None:
    """A time as epoch seconds: a number, a datetime, or an ISO 8601 string; ValueError naming `field` else."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and math.isfinite(number):
            return number
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise ValueError(f"a generation's {field} is {str(value)[:40]!r}, not a time")


def _tracer(observations: list[dict[str, Any]]) -> str:
    names = {str(o.get("name") or "") for o in observations}
    if any(n.startswith("OpenAI-generation") for n in names):
        return "langfuse.openai"
    metadata = [o.get("metadata") or {} for o in observations]
    if any("ls_provider" in m or "langgraph_node" in m for m in metadata) or any(
        n in {"ChatOpenAI", "RunnableSequence", "LangGraph"} for n in names
    ):
        return "langchain"
    return "langfuse"


def _rewarded(
    trajectory: Trajectory,
    scores: list[tuple[str, Any, str]],
    rewarder: Rewarder,
    stats: ImportStats,
    min_scores: Mapping[str, float] | None,
    missing: float | None,
) -> bool:
    numbers = rewarder.numbers(scores)
    for name, least in (min_scores or {}).items():
        if numbers.get(name, -math.inf) < least:
            stats.skipped_by_score += 1
            return False
    reward = rewarder(numbers)
    if reward is not None and not math.isfinite(reward):  # NaN or infinity is no reward (as read_otlp has it)
        reward = None
    own = trajectory.metadata.get("trace_source") == "art_adapters"
    if reward is None and own and math.isfinite(trajectory.reward) and not reward_missing(trajectory):
        return True  # its recorded reward (one recorded as missing is no reward: below)
    if reward is None and any(c.reward is not None for c in trajectory.llm_calls):
        reward = 0.0  # its calls carry the rewards: not missing
    if reward is None:
        if missing is None:
            stats.skipped_no_reward += 1
            return False
        reward = missing
    trajectory.reward = reward
    if not own:
        trajectory.metrics.update(numbers)
    return True


def _client(public_key: str | None, secret_key: str | None, base_url: str | None, timeout_s: float) -> Any:
    try:
        from langfuse import Langfuse
    except ImportError as error:
        raise ImportError(
            "importing from Langfuse needs `pip install langfuse` (or art-adapters[langfuse])"
        ) from error
    public_key = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
    secret_key = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
    base_url = base_url or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
    if not public_key or not secret_key:
        raise ValueError(
            "Langfuse keys missing: pass public_key/secret_key or set LANGFUSE_PUBLIC_KEY/SECRET_KEY"
        )
    return Langfuse(
        public_key=public_key, secret_key=secret_key, base_url=base_url, timeout=max(1, round(timeout_s))
    )


def _progress(show: bool, total: int | None) -> Any:
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Importing traces", unit="trace")
