"""Production data, in one run: the training metadata's size per generation (and its cost to build, as a ratio to a
trace plan without it), then import throughput from a local server speaking Langfuse's API (pages of 100), our
traces with training records against the same traces without (the baseline: imported as foreign).

Usage: python bench/production_import.py [--traces 400]
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import time
import uuid

from art_adapters.testing.langfuse_api import LangfuseAPIServer
from art_adapters.tracing._convert import plan_trace
from art_adapters.tracing._records import CALL_KEY, pack_call
from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories
from art_adapters.trajectories import LLMCall, Trajectory


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def sampled_call(rng: random.Random, prompt: int, completion: int, vocab: int, t0: float) -> LLMCall:
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(prompt // 2))
    answer = " ".join(f"a{rng.randrange(1000)}" for _ in range(completion // 2))
    return LLMCall(
        request={"model": "agent", "messages": [{"role": "user", "content": words}], "temperature": 1.0},
        response={
            "model": "agent",
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        },
        url="http://127.0.0.1:8000/v1/chat/completions",
        status_code=200,
        prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt)],
        completion_token_ids=[rng.randrange(vocab) for _ in range(completion)],
        logprobs=[_float32(-rng.random() * 5) for _ in range(completion)],  # vLLM's are float32 values
        started_at=t0,
        latency_s=0.5,
        policy_version=3,
        served_model="proj/agent@3",
        source={"framework": "langgraph", "node": "agent"},  # type: ignore[arg-type]
    )


def sizes() -> list[dict[str, object]]:
    rng = random.Random(0)
    rows = []
    for prompt, completion in ((256, 64), (1024, 256), (3072, 1024)):
        for vocab, label in ((768, "byte vocab (uint16 ids)"), (151_936, "Qwen vocab (uint32 ids)")):
            call = sampled_call(rng, prompt, completion, vocab, time.time())
            record = pack_call(call, 0)
            generation = plan_trace(
                Trajectory(llm_calls=[call]).finish(), trace_id="0" * 32, training_data=False
            )
            (gen,) = [o for o in generation.children if o.kind == "generation"]
            shown = len(json.dumps([gen.input, gen.output, gen.metadata, gen.usage, gen.model_parameters]))
            rows.append(
                {
                    "tokens": f"{prompt} + {completion}",
                    "vocabulary": label,
                    "record_bytes": len(record),
                    "bytes_per_token": round(len(record) / (prompt + completion), 2),
                    "vs_generation_payload": round(len(record) / shown, 2),
                }
            )
    return rows


def build_cost(n: int = 200) -> tuple[float, float]:
    """Time to plan a 2-call trace with training data / without (the exporter's worker thread does this)."""
    rng = random.Random(1)
    trajectories = [
        Trajectory(llm_calls=[sampled_call(rng, 1024, 256, 151_936, time.time()) for _ in range(2)]).finish()
        for _ in range(n)
    ]
    timings = {}
    for flag in (False, True):
        started = time.perf_counter()
        for t in trajectories:
            plan_trace(t, trace_id=uuid.uuid4().hex, training_data=flag)
        timings[flag] = time.perf_counter() - started
    return timings[True] / timings[False], (timings[True] - timings[False]) / (2 * n) * 1000


def throughput(traces: int) -> dict[str, float]:
    rng = random.Random(2)
    out: dict[str, float] = {}
    for flag in (False, True):
        public = f"pk-bench-{uuid.uuid4().hex[:8]}"
        with LangfuseAPIServer(public, "sk") as server:
            exporter = LangfuseExporter(
                public, "sk", server.base_url, training_data=flag, max_queue=traces + 10
            )
            batch = [
                Trajectory(
                    llm_calls=[sampled_call(rng, 512, 128, 151_936, time.time() - 100 + k) for k in range(2)],
                    reward=rng.random(),
                ).finish()
                for _ in range(traces)
            ]
            started = time.perf_counter()
            exporter.export(batch, step=3)
            assert exporter.flush(300), "export did not finish"
            exporter.close()
            assert server.wait_for(traces, scores=traces, timeout_s=120)
            out[f"export_traces_per_s_{'records' if flag else 'plain'}"] = traces / (
                time.perf_counter() - started
            )
            started = time.perf_counter()
            imported = import_trajectories(public, "sk", server.base_url, page_size=100, progress=False)
            count = sum(1 for _ in imported)
            seconds = time.perf_counter() - started
            assert count == traces and imported.stats.pages == -(-traces // 100)
            out[f"import_traces_per_s_{'own' if flag else 'foreign'}"] = traces / seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=int, default=400)
    args = parser.parse_args()
    print("## training metadata per generation (`art_training`)")
    print(
        "| tokens (prompt + completion) | vocabulary | record bytes | bytes/token | x generation's other payload |"
    )
    print("|---|---|---|---|---|")
    for row in sizes():
        print(
            f"| {row['tokens']} | {row['vocabulary']} | {row['record_bytes']:,} | {row['bytes_per_token']} "
            f"| {row['vs_generation_payload']} |"
        )
    ratio, ms = build_cost()
    print(f"\nbuilding a trace plan with training data / without: {ratio:.2f}x (+{ms:.2f} ms per generation)")
    figures = throughput(args.traces)
    print(f"\n## import, {args.traces} traces of 2 generations, pages of 100")
    for key, value in figures.items():
        print(f"- {key}: {value:.1f}")
    print(
        f"- own (records) / foreign import speed: "
        f"{figures['import_traces_per_s_own'] / figures['import_traces_per_s_foreign']:.2f}x"
    )
    print(
        f"- export with records / without: "
        f"{figures['export_traces_per_s_records'] / figures['export_traces_per_s_plain']:.2f}x"
    )
    print(f"(training-data key: {CALL_KEY})")


if __name__ == "__main__":
    main()
