"""Multi-turn rollouts through the gateway against 1 engine and 2 (vLLM's data parallelism, `InferenceConfig(replicas=
N)`), on the tiny model: captured calls/s and vLLM's prefix-cache hit rate, with each rollout's calls kept on one
engine (the gateway's rollout-sticky routing) and, for comparison, spread by vLLM's own balancer.

    python bench/replicas.py [--rollouts 24] [--turns 4] [--concurrency 8] [--rounds 2]

Each rollout opens with a context of its own (a few hundred tokens) and adds a turn per call, so every call after
the first can reuse its rollout's prefix, if it reaches the engine that holds it. On a 2-core CPU the replicas
share the same cores: calls/s shows the second engine's cost, not a speed-up; the hit rate is what routing buys.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


async def prefix_cache(server: Any) -> tuple[float, float]:
    """vLLM's prefix-cache hits and queries so far (tokens, summed over its engines)."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{server.root_url}/metrics", headers=server.headers)).text

    def total(name: str) -> float:
        return sum(float(x) for x in re.findall(rf"^{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return total("vllm:prefix_cache_hits"), total("vllm:prefix_cache_queries")


async def run_rollouts(gateway: Any, name: str, args: argparse.Namespace, sticky: bool, salt: str) -> float:
    import art_adapters as art
    from art_adapters.recording import async_openai_client

    client = async_openai_client(base_url=gateway.base_url, api_key=gateway.api_key, request_token_ids=True)
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(k: int) -> None:
        context = " ".join(f"fact {salt}-{k}-{i}: the value is {i * 7 % 11}." for i in range(40))
        messages: list[dict[str, Any]] = [{"role": "system", "content": context}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Question {turn}: what is fact {turn}?"})
            reply = await client.chat.completions.create(model=name, messages=messages, max_tokens=8, seed=k)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

    async def rollout(k: int) -> None:
        async with gate:
            if sticky:  # in a capture scope: the recording client names the rollout, the gateway keeps it on one engine
                async with art.capture():
                    await conversation(k)
            else:  # outside one: no rollout to keep together, vLLM's balancer spreads the calls
                await conversation(k)

    started = time.perf_counter()
    await asyncio.gather(*(rollout(k) for k in range(args.rollouts)))
    return args.rollouts * args.turns / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from art_adapters.inference import InferenceConfig, VLLMServer, write_zero_adapter
    from art_adapters.inference.gateway import gateway_of, stop_gateway
    from art_adapters.tiny import tiny_model_path

    adapter = write_zero_adapter(tiny_model_path(), Path(tempfile.mkdtemp()) / "step0")
    servers = {n: VLLMServer(tiny_model_path(), InferenceConfig(replicas=n, max_num_seqs=16)) for n in (1, 2)}
    await asyncio.gather(*(s.start() for s in servers.values()))
    modes = {
        "1 engine": (1, True),
        "2 engines, rollout-sticky": (2, True),
        "2 engines, vLLM's balancer": (2, False),
    }
    rates: dict[str, list[float]] = {m: [] for m in modes}
    hits: dict[str, list[float]] = {m: [] for m in modes}
    try:
        gateways = {n: gateway_of(s) for n, s in servers.items()}
        for gateway in gateways.values():
            await gateway.publish("bench/m", "m", 0, adapter)
        for r in range(args.rounds):  # interleaved, so load changes hit every mode alike
            for mode, (n, sticky) in modes.items():
                before = await prefix_cache(servers[n])
                rates[mode].append(await run_rollouts(gateways[n], "bench/m", args, sticky, f"{r}-{mode}"))
                after = await prefix_cache(servers[n])
                hits[mode].append((after[0] - before[0]) / max(after[1] - before[1], 1.0))
    finally:
        for server in servers.values():
            stop_gateway(server)
        await asyncio.gather(*(s.stop() for s in servers.values()))
    print(f"\n{args.rollouts} rollouts x {args.turns} turns x {args.rounds} rounds, {args.concurrency} in flight, "
          "through the gateway, tiny model, CPU\n")  # fmt: skip
    print("| engines | captured calls/s (median) | prefix-cache hit rate (median) |")
    print("|---|---:|---:|")
    for mode in modes:
        print(f"| {mode} | {statistics.median(rates[mode]):.1f} | {statistics.median(hits[mode]):.1%} |")
    one, sticky, spread = (statistics.median(hits[m]) for m in modes)
    ratio = statistics.median(rates["2 engines, rollout-sticky"]) / statistics.median(rates["1 engine"])
    print(f"\n- 2 engines vs 1: {ratio:.2f}x calls/s; hit rate {sticky:.1%} rollout-sticky vs {spread:.1%} spread "
          f"by vLLM's balancer (1 engine: {one:.1%})")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
