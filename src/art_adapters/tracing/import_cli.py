"""`art-adapters import`: Langfuse traces (or OTLP/JSON files of GenAI spans) to a JSONL file of Trajectories,
streamed (a page of traces in memory at a time), with the import's counts at the end."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from ..trajectories import Trajectory, write_jsonl


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


def import_command(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="art-adapters import",
        description="Write production traces as Trajectories (JSONL) for training: from Langfuse (keys and URL as "
        "the SDK reads them: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_BASE_URL) or from OTLP/JSON files.",
    )
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument(
        "--otlp", action="append", default=[], metavar="FILE", help="OTLP/JSON file (repeatable)"
    )
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--public-key", default=None)
    parser.add_argument("--secret-key", default=None)
    parser.add_argument("--name", default=None, help="trace name")
    parser.add_argument("--tag", action="append", default=None, help="a tag every trace has (repeatable)")
    parser.add_argument("--session", default=None)
    parser.add_argument("--user", default=None)
    parser.add_argument(
        "--from", dest="from_time", type=datetime.fromisoformat, default=None, help="ISO time"
    )
    parser.add_argument("--to", dest="to_time", type=datetime.fromisoformat, default=None, help="ISO time")
    parser.add_argument(
        "--reward", default="reward", help="the score (Langfuse) or attribute (OTLP) to train on"
    )
    parser.add_argument(
        "--category",
        action="append",
        type=_pair,
        default=[],
        metavar="SCORE:CATEGORY=NUMBER",
        help="map a categorical score's category to a number (repeatable)",
    )
    parser.add_argument("--min-score", action="append", type=_pair, default=[], metavar="SCORE=NUMBER")
    parser.add_argument("--missing-reward", type=float, default=None, help="reward of traces without one")
    parser.add_argument("--limit", type=int, default=None, help="at most this many traces")
    parser.add_argument("--no-redact", action="store_true", help="keep API keys and Authorization headers")
    args = parser.parse_args(argv)
    redact = None if args.no_redact else "default"
    categories: dict[str, dict[str, float]] = {}
    for name, number in args.category:
        score, _, category = name.partition(":")
        categories.setdefault(score, {})[category] = float(number)
    out = Path(args.out)
    writing = _Writable()
    kwargs = {} if redact else {"redact": None}
    if args.otlp:
        from .otel_genai import read_otlp

        counts: dict[str, int] = {}
        read = read_otlp(
            args.otlp, reward=args.reward, missing_reward=args.missing_reward, stats=counts, **kwargs
        )
        write_jsonl(out, writing(read))
        stats: dict[str, object] = {
            "imported": writing.written,
            "reward_missing": counts.get("no_reward", 0),  # flagged: skipped by groupings and the trainer
            "skipped_no_messages": counts.get("no_messages", 0),
        }
    else:
        from .langfuse_import import import_trajectories

        imported = import_trajectories(
            args.public_key,
            args.secret_key,
            args.base_url,
            name=args.name,
            tags=args.tag,
            session_id=args.session,
            user_id=args.user,
            from_time=args.from_time,
            to_time=args.to_time,
            reward=args.reward,
            categories=categories or None,
            min_scores={k: float(v) for k, v in args.min_score} or None,
            missing_reward=args.missing_reward,
            limit=args.limit,
            progress=sys.stderr.isatty(),
            **kwargs,
        )
        from ._langfuse_read import PagingError

        failed: PagingError | None = None
        try:
            write_jsonl(out, writing(imported))
        except PagingError as error:  # what was read so far stays written; the counts say how far it got
            failed = error
        stats = imported.stats.model_dump()
        stats["written"] = writing.written
        if writing.escaped:
            stats["surrogates_escaped"] = writing.escaped
        if writing.unwritable:
            stats["skipped_unwritable"] = writing.unwritable
        print(json.dumps({"out": str(out), **stats}))
        if failed is not None:
            print(f"art-adapters import: stopped: {failed}", file=sys.stderr)
            return 1
        return 0
    print(json.dumps({"out": str(out), **stats, "written": writing.written}))
    return 0


class _Writable:
    """Trajectories as `write_jsonl` can write them: a lone UTF-16 surrogate (a string cut inside a character) is
    written escaped (as the text \\udXXX, warned); one that still cannot be serialized is skipped, counted, warned."""

    def __init__(self) -> None:
        self.written = 0
        self.escaped = 0
        self.unwritable = 0

    def __call__(self, trajectories: Iterable[Trajectory]) -> Iterator[Trajectory]:
        for trajectory in trajectories:
            writable = self._writable(trajectory)
            if writable is not None:
                yield writable
                self.written += 1

    def _writable(self, trajectory: Trajectory) -> Trajectory | None:
        name = trajectory.metadata.get("trace_id", "?")
        try:
            trajectory.model_dump_json()
            return trajectory
        except Exception as error:  # noqa: BLE001 - one trajectory never stops the file
            first = error
        try:
            escaped = Trajectory.model_validate(_escaped(trajectory.model_dump()))
            escaped.model_dump_json()
        except Exception as error:  # noqa: BLE001
            self.unwritable += 1
            print(f"trace {name}: skipped, it cannot be written as JSON ({first}; {error})", file=sys.stderr)
            return None
        self.escaped += 1
        print(f"trace {name}: lone UTF-16 surrogates written escaped (\\udXXX)", file=sys.stderr)
        return escaped


def _escaped(value: Any) -> Any:
    """Every string with its lone surrogates as backslash escapes (valid UTF-8); bounded by the data's depth."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    return value
