"""`art-adapters import`: Langfuse traces (or OTLP/JSON files of GenAI spans) to a JSONL file of Trajectories,
streamed (a page of traces in memory at a time), with the import's counts at the end."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path


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
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w", encoding="utf-8") as f:
        if args.otlp:
            from .otel_genai import read_otlp

            kwargs = {} if redact else {"redact": None}
            for trajectory in read_otlp(
                args.otlp, reward=args.reward, missing_reward=args.missing_reward, **kwargs
            ):
                f.write(trajectory.model_dump_json() + "\n")
                written += 1
            stats: dict[str, object] = {"imported": written}
        else:
            from .langfuse_import import import_trajectories

            kwargs = {} if redact else {"redact": None}
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
            for trajectory in imported:
                f.write(trajectory.model_dump_json() + "\n")
                written += 1
            stats = imported.stats.model_dump()
    print(json.dumps({"out": str(out), **stats}))
    return 0
