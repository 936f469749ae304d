"""Per-call cost of recording: raw AsyncOpenAI vs our recording client (inside capture) vs Langfuse's drop-in.

Each variant runs in its own worker process (Langfuse's drop-in patches openai globally), against one local
ScriptedServer; rounds are interleaved (rotating order) so machine noise hits every variant alike.
Processes sharing 2 cores drift apart by ±15%, more than the effect measured, so a last, paired measurement runs raw
and recorded calls alternately in one process (same heap, same moment): its ratio is the headline figure.
Usage: python bench/capture_overhead.py [--calls 2000] [--rounds 10] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

SYSTEM = "You are a careful assistant. " * 20
REPLY = "The answer is four, because two plus two equals four. " * 4
VARIANTS = ["raw", "raw-httpx", "recorded", "langfuse"]
LABELS = {
    "raw": "raw `AsyncOpenAI` (httpx2)",
    "raw-httpx": "raw `AsyncOpenAI(http_client=httpx.AsyncClient())`",
    "recorded": "ours: `async_openai_client` inside `capture()`",
    "langfuse": "Langfuse `langfuse.openai.AsyncOpenAI` (tracing on)",
}


def dead_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# ---- worker -------------------------------------------------------------------------------------------------


def make_call(variant: str, base_url: str) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"}]
    if variant == "langfuse":
        from langfuse.openai import AsyncOpenAI  # patches openai: this process only

        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    elif variant == "recorded":
        from art_adapters.recording import async_openai_client

        client = async_openai_client(base_url, "x", max_retries=0)
    elif variant == "raw-httpx":
        import httpx
        import openai

        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=500)
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key="x", max_retries=0, http_client=httpx.AsyncClient(limits=limits)
        )
    else:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

    if variant == "recorded":
        from art_adapters.capture import capture

        async def call() -> float:
            start = time.perf_counter()
            async with capture() as trajectory:
                await client.chat.completions.create(model="m", messages=messages)
            assert len(trajectory.llm_calls) == 1
            return time.perf_counter() - start
    else:

        async def call() -> float:
            start = time.perf_counter()
            await client.chat.completions.create(model="m", messages=messages)
            return time.perf_counter() - start

    return call


def paired(base_url: str, calls: int) -> None:
    """Raw and recorded calls alternately (which goes first alternates too), in this one process."""
    raw, recorded = make_call("raw", base_url), make_call("recorded", base_url)

    async def run() -> dict[str, list[float]]:
        for _ in range(50):
            await raw()
            await recorded()
        out: dict[str, list[float]] = {"raw": [], "recorded": []}
        pair = [("raw", raw), ("recorded", recorded)]
        for k in range(calls):
            for name, call in pair if k % 2 == 0 else pair[::-1]:
                out[name].append(await call())
        return out

    print(json.dumps(asyncio.run(run())), flush=True)


def worker(variant: str, base_url: str) -> None:
    if (
        variant == "langfuse"
    ):  # no Langfuse server here: the table's caption says so once, the SDK's retries are off
        import logging

        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        logging.getLogger("langfuse").setLevel(logging.CRITICAL)
    call = make_call(variant, base_url)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):  # warm-up: connections, imports, caches
            await call()
        print("ready", flush=True)
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            mode, n, concurrency = line.split()
            start, cpu = time.perf_counter(), time.process_time()
            if mode == "seq":
                latencies = [await call() for _ in range(int(n))]
            else:
                semaphore = asyncio.Semaphore(int(concurrency))

                async def bounded(semaphore: asyncio.Semaphore = semaphore) -> float:
                    async with semaphore:
                        return await call()

                latencies = list(await asyncio.gather(*[bounded() for _ in range(int(n))]))
            out = {
                "latencies": latencies,
                "wall": time.perf_counter() - start,
                "cpu": time.process_time() - cpu,
            }
            print(json.dumps(out), flush=True)

    asyncio.run(serve())
    os._exit(0)  # don't wait for exporters retrying a dead endpoint


# ---- coordinator --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--worker", choices=[*VARIANTS, "paired"])
    parser.add_argument("--base-url")
    args = parser.parse_args()
    if args.worker == "paired":
        paired(args.base_url, args.calls)
        return
    if args.worker:
        worker(args.worker, args.base_url)
        return

    from art_adapters.testing import Reply, ScriptedServer

    env = dict(os.environ)
    port = dead_port()
    env.update(
        LANGFUSE_PUBLIC_KEY="pk-lf-bench",
        LANGFUSE_SECRET_KEY="sk-lf-bench",
        LANGFUSE_HOST=f"http://127.0.0.1:{port}",
        LANGFUSE_BASE_URL=f"http://127.0.0.1:{port}",
        LANGFUSE_TRACING_ENABLED="true",
    )
    per_round = args.calls // args.rounds
    results: dict[str, dict[str, list[float]]] = {
        v: {"seq": [], "conc": [], "wall": [], "cpu": []} for v in VARIANTS
    }
    with ScriptedServer(Reply(content=REPLY), cycle=True) as server:
        procs = {
            v: subprocess.Popen(
                [sys.executable, __file__, "--worker", v, "--base-url", server.base_url],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for v in VARIANTS
        }
        for v, proc in procs.items():
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", v
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for mode in ("seq", "conc"):
                for v in order:
                    proc = procs[v]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{mode} {per_round} {args.concurrency}\n")
                    proc.stdin.flush()
                    out = json.loads(proc.stdout.readline())
                    results[v][mode] += out["latencies"]
                    results[v]["cpu"].append(out["cpu"] / per_round)
                    if mode == "conc":
                        results[v]["wall"].append(out["wall"])
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in procs.values():
            proc.wait(30)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                "paired",
                "--base-url",
                server.base_url,
                "--calls",
                str(args.calls),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        pairs = json.loads(out.stdout.strip().splitlines()[-1])
    print(table(results, args))
    raw, recorded = statistics.median(pairs["raw"]), statistics.median(pairs["recorded"])
    print(
        f"\nPaired, one process, {args.calls} calls each alternating: raw {raw * 1000:.3f} ms, recorded "
        f"{recorded * 1000:.3f} ms, **recorded/raw {recorded / raw:.3f}** (target <= 1.02)"
    )


def table(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    seq = {v: statistics.median(r["seq"]) for v, r in results.items()}
    conc = {v: statistics.median(r["conc"]) for v, r in results.items()}
    rate = {v: len(r["conc"]) / sum(r["wall"]) for v, r in results.items()}
    cpu = {v: statistics.median(r["cpu"]) for v, r in results.items()}
    lines = [
        f"{args.calls} calls per variant and mode, {args.rounds} interleaved rounds, concurrent = {args.concurrency} in flight",
        "(no Langfuse server runs here: its drop-in is measured with its exports failing, their retries silenced)",
        "",
        "| client | sequential median ms | vs raw | concurrent median ms | vs raw | concurrent calls/s "
        "| client CPU µs/call | vs raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        lines.append(
            f"| {LABELS[v]} | {seq[v] * 1000:.3f} | {seq[v] / seq['raw']:.3f} | {conc[v] * 1000:.3f} | "
            f"{conc[v] / conc['raw']:.3f} | {rate[v]:.0f} | {cpu[v] * 1e6:.0f} | {cpu[v] / cpu['raw']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
