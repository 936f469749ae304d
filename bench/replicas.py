"""Captured calls/s with 2 engine replicas vs 1 (vLLM's data parallelism, `InferenceConfig(replicas=N)`), on the tiny
model: the same concurrent captured calls (token ids and logprobs recorded) against each, interleaved rounds.

    python bench/replicas.py [--calls 64] [--concurrency 16] [--rounds 3]

On a 2-core CPU the replicas share the same cores, so this shows the cost of the second engine, not a speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any


async def calls_per_second(server: Any, calls: int, concurrency: int) -> float:
    import art_adapters as art
    from art_adapters.recording import async_openai_client

    client = async_openai_client(
        base_url=server.base_url,
        api_key=server.api_key,
        request_token_ids=True,
    )
    gate = asyncio.Semaphore(concurrency)

    async def one(k: int) -> int:
        async with gate, art.capture() as trajectory:
            await client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": f"Say something ({k})."}],
                max_tokens=16,
                seed=k,
            )
        return len(trajectory.llm_calls[0].completion_token_ids or [])

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(k) for k in range(calls)))
    elapsed = time.perf_counter() - started
    assert all(tokens), "every call was captured with its token ids"
    return calls / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from art_adapters.inference import InferenceConfig, VLLMServer
    from art_adapters.tiny import tiny_model_path

    servers = {n: VLLMServer(tiny_model_path(), InferenceConfig(replicas=n, max_num_seqs=16)) for n in (1, 2)}
    await asyncio.gather(*(s.start() for s in servers.values()))
    try:
        rates: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.rounds):  # interleaved, so load changes hit both alike
            for n, server in servers.items():
                rates[n].append(await calls_per_second(server, args.calls, args.concurrency))
    finally:
        await asyncio.gather(*(s.stop() for s in servers.values()))
    print(
        f"\n{args.calls} captured calls x {args.rounds} rounds, {args.concurrency} in flight, tiny model, CPU\n"
    )
    print("| engines | captured calls/s (median) |")
    print("|---|---:|")
    for n, values in rates.items():
        print(f"| {n} | {statistics.median(values):.1f} |")
    ratio = statistics.median(rates[2]) / statistics.median(rates[1])
    print(f"\n- 2 replicas vs 1: {ratio:.2f}x captured calls/s")


if __name__ == "__main__":
    asyncio.run(main())
