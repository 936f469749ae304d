"""Send one trajectory to a Langfuse server through LangfuseExporter and read it back via the public API.

    LANGFUSE_PUBLIC_KEY=pk-lf-... LANGFUSE_SECRET_KEY=sk-lf-... LANGFUSE_BASE_URL=http://localhost:3000 \\
        python integrations/langfuse/check_roundtrip.py [--wait 180]

Exit status 0 when the trace came back with its agent root, 2 generations, 1 tool observation, the reward score,
the session id and the tags; 1 otherwise (what differs is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import httpx

from art_adapters.tracing.langfuse import LangfuseExporter
from art_adapters.trajectories import LLMCall, Trajectory


def sample_trajectory() -> Trajectory:
    """A two-call tool rollout, shaped as the capture records one."""
    t0 = time.time() - 2.0
    call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function"}
    call["function"] = {"name": "add", "arguments": '{"a": 2, "b": 2}'}
    question = [{"role": "user", "content": "What is 2+2?"}]
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "4"}
    first = LLMCall(
        request={"model": "roundtrip-model", "messages": question},
        response={
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": assistant}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
        },
        started_at=t0,
        latency_s=0.4,
    )
    second = LLMCall(
        request={"model": "roundtrip-model", "messages": [*question, assistant, result]},
        response={
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}
            ],
            "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
        },
        started_at=t0 + 0.6,
        latency_s=0.2,
    )
    return Trajectory(
        llm_calls=[first, second], reward=1.0, metrics={"correct": True}, start_time=t0
    ).finish()


def problems(trace: dict[str, Any], session_id: str) -> list[str]:
    """What the trace read back lacks (empty when it is complete)."""
    kinds = [str(o.get("type", "")).upper() for o in trace.get("observations") or []]
    scores = {s.get("name"): s.get("value") for s in trace.get("scores") or [] if isinstance(s, dict)}
    found = {
        "agent root": kinds.count("AGENT") == 1,
        "2 generations": kinds.count("GENERATION") == 2,
        "1 tool observation": kinds.count("TOOL") == 1,
        "reward score 1.0": scores.get("reward") == 1.0,
        f"session {session_id}": trace.get("sessionId") == session_id,
        "tags train, step:0": {"train", "step:0"} <= set(trace.get("tags") or []),
    }
    return [name for name, ok in found.items() if not ok]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
    )
    parser.add_argument("--public-key", default=os.environ.get("LANGFUSE_PUBLIC_KEY"))
    parser.add_argument("--secret-key", default=os.environ.get("LANGFUSE_SECRET_KEY"))
    parser.add_argument(
        "--wait", type=float, default=180.0, help="seconds to poll for the trace (ingestion is async)"
    )
    args = parser.parse_args(argv)
    if not (args.base_url and args.public_key and args.secret_key):
        parser.error("set LANGFUSE_BASE_URL, LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY (or pass the flags)")

    session_id = f"roundtrip-{uuid.uuid4().hex[:8]}"
    exporter = LangfuseExporter(args.public_key, args.secret_key, args.base_url, session_id=session_id)
    (trace_id,) = exporter.export(sample_trajectory(), step=0, split="train")
    sent = exporter.flush(30)
    exporter.close()
    print(f"sent trace {trace_id} (flush {'ok' if sent else 'reported problems'})")

    url = f"{args.base_url.rstrip('/')}/api/public/traces/{trace_id}"
    deadline = time.monotonic() + args.wait
    missing = ["the trace"]
    with httpx.Client(auth=(args.public_key, args.secret_key), timeout=10) as http:
        while time.monotonic() < deadline:
            try:
                response = http.get(url)
            except httpx.HTTPError as error:
                print(f"  GET failed: {error!r}")
                response = None
            if response is not None and response.status_code == 200:
                missing = problems(response.json(), session_id)
                if not missing:
                    trace = response.json()
                    print(f"ok: {len(trace['observations'])} observations, scores {trace['scores']}")
                    return 0
            time.sleep(2.0)
    print(f"FAILED after {args.wait:.0f}s: missing {', '.join(missing)} at {url}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
