"""Throughput of 256 concurrent LangGraph rollouts against a local ScriptedServer: captured vs raw (target >= 0.95).

    python bench/rollout_throughput.py [--rollouts 256] [--rounds 9]

The server runs in a subprocess (its own GIL); each rollout is a hand-built StateGraph + ToolNode agent making two
LLM calls (a tool call, then the answer). "raw" runs the same graph undecorated; "captured" under `wrap_rollout`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import subprocess
import sys
import time
from typing import Any


def serve() -> None:
    from art_adapters.testing import Reply, ScriptedServer

    def responder(request: dict[str, Any]) -> Reply:
        if request["messages"][-1]["role"] == "tool":
            return Reply(content="The answer is " + request["messages"][-1]["content"])
        return Reply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}])

    server = ScriptedServer(responder).start()
    print(server.base_url, flush=True)
    sys.stdin.read()  # until the parent closes the pipe
    server.stop()


def build_graph(base_url: str) -> Any:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(base_url=base_url, api_key="x", model="agent", max_retries=0, timeout=120).bind_tools(
        [add]
    )

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


async def measure(rollouts: int, rounds: int, base_url: str) -> dict[str, list[float]]:
    import art_adapters as art
    from art_adapters.langgraph import wrap_rollout

    graph = build_graph(base_url)
    model = art.Model(name="agent", inference_base_url=base_url, inference_api_key="x")

    async def raw(k: int) -> int:
        state = await graph.ainvoke({"messages": [{"role": "user", "content": f"2 + 3? ({k})"}]})
        return len(state["messages"]) // 2  # two LLM calls

    @wrap_rollout(model)
    async def captured(k: int) -> float:
        await graph.ainvoke({"messages": [{"role": "user", "content": f"2 + 3? ({k})"}]})
        return 1.0

    async def run(mode: str) -> tuple[float, float]:
        gc.collect()  # each round starts from the same heap: a full collection mid-round costs ~0.2 s either way
        start, cpu = time.perf_counter(), time.process_time()
        if mode == "raw":
            calls = sum(await asyncio.gather(*(raw(k) for k in range(rollouts))))
        else:
            trajectories = await asyncio.gather(*(captured(k) for k in range(rollouts)))
            calls = sum(len(t.llm_calls) for t in trajectories)
            assert calls == 2 * rollouts, calls
        return calls / (time.perf_counter() - start), (time.process_time() - cpu) / calls * 1e3

    await run("raw")  # warm-up: connections, imports, caches
    await run("captured")
    results: dict[str, list[tuple[float, float]]] = {"raw": [], "captured": []}
    for k in range(rounds):
        for mode in ("raw", "captured") if k % 2 == 0 else ("captured", "raw"):
            results[mode].append(await run(mode))
    return results


async def overhead_us(calls: int = 2000) -> tuple[float, float]:
    """Per-call cost (µs) of an AsyncOpenAI call on an in-memory httpx2 transport: raw, and inside `wrap_rollout`."""
    import json

    import httpx2
    import openai

    import art_adapters as art
    from art_adapters.adapters.base import scope

    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            ],
        }
    ).encode()

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "application/json"}, content=body)

    base_url = "http://memory.test/v1"
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="x",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
    )
    messages = [{"role": "user", "content": "hello"}]
    model = art.Model(name="m", inference_base_url=base_url)

    async def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await client.chat.completions.create(model="m", messages=messages)
        return (time.perf_counter() - start) / n * 1e6

    async def captured(n: int) -> float:
        with scope(model) as trajectory:
            value = await run(n)
        assert len(trajectory.llm_calls) == n
        return value

    await run(200)
    await captured(200)
    raw = min([await run(calls // 4) for _ in range(4)])
    cap = min([await captured(calls // 4) for _ in range(4)])
    return raw, cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        base_url = server.stdout.readline().strip()
        results = asyncio.run(measure(args.rollouts, args.rounds, base_url))
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(30)
    rate = {m: statistics.median(r[0] for r in results[m]) for m in results}
    best = {m: max(r[0] for r in results[m]) for m in results}
    cpu = {m: statistics.median(r[1] for r in results[m]) for m in results}
    print(
        f"\n{args.rollouts} concurrent LangGraph rollouts (2 LLM calls each), median of {args.rounds} rounds\n"
    )
    print("| mode | calls/s (median) | calls/s (best) | client CPU ms/call (median) |")
    print("|---|---:|---:|---:|")
    for mode in ("raw", "captured"):
        print(f"| {mode} | {rate[mode]:,.0f} | {best[mode]:,.0f} | {cpu[mode]:.2f} |")
    print(
        f"| **ratio captured/raw** | **{rate['captured'] / rate['raw']:.3f}** | {best['captured'] / best['raw']:.3f} "
        f"| {cpu['raw'] / cpu['captured']:.3f} (raw/captured) |"
    )
    raw_us, cap_us = asyncio.run(overhead_us())
    print(
        f"\nPer call, in-memory transport (no network): raw {raw_us:.0f} µs, captured {cap_us:.0f} µs "
        f"(+{cap_us - raw_us:.0f} µs for recording)"
    )


if __name__ == "__main__":
    main()
