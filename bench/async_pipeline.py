"""Sync vs async training on the same workload and sample budget, in one run: the demo's task (the tiny model, its
warm start shared), S steps of 8 scenario groups x G rollouts each way, then the same evaluation.

Engine idle = the share of the run's wall time with no request in flight at the engine (from its gateway); trainer
idle = the share not spent in training steps; staleness = trained step - the version that sampled (mean per group).
Usage: python bench/async_pipeline.py [--steps 8] [--group-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import art_adapters as art
    from art_adapters.demo import (
        SCENARIOS,
        evaluate,
        scenario_groups,
        train_demo_async,
        warm_start_examples,
    )
    from art_adapters.inference import InferenceConfig
    from art_adapters.tiny import tiny_model_path

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    backend = art.LocalBackend(root, inference=InferenceConfig(max_model_len=1024, max_lora_rank=16))
    lora = art.LoRAConfig(rank=16, alpha=32)
    modes = {"sync": 0, **{f"async, <= {k} step off-policy": k for k in args.max_steps_off_policy}}
    base = str(tiny_model_path())
    models = {
        mode: art.TrainableModel(name=f"agent-{i}", project="bench", base_model=base, lora=lora)
        for i, mode in enumerate(modes)
    }
    rows: list[dict[str, Any]] = []
    try:
        await models["sync"].register(backend)
        await models["sync"].train_sft(
            warm_start_examples(64, 0), config=art.SFTConfig(learning_rate=5e-3, epochs=32, batch_size=16)
        )
        # the async models start from the very same warm start (its checkpoint, optimizer state included)
        for mode, model in models.items():
            if mode != "sync":
                warm = backend.model_dir(models["sync"]) / "checkpoints"
                shutil.copytree(warm, backend.model_dir(model) / "checkpoints")
                await model.register(backend)
        gateway = next(iter(backend._models.values())).gateway
        config = art.TrainConfig(learning_rate=1.5e-3)
        samples = args.steps * len(SCENARIOS) * args.group_size
        for mode, model in models.items():
            trained_s: list[float] = []
            staleness: list[float] = []
            discarded = 0.0
            busy, started = gateway.busy_seconds(), time.perf_counter()
            if mode == "sync":
                for k in range(args.steps):
                    groups = await art.gather_trajectory_groups(
                        scenario_groups(model, args.group_size, 1_000_003 + k * 10_007), pbar_desc=None
                    )
                    t0 = time.perf_counter()
                    await model.train(groups, config=config)
                    trained_s.append(time.perf_counter() - t0)
                    staleness.append(0.0)
            else:
                reports = await train_demo_async(
                    model,
                    backend,
                    config,
                    args.steps,
                    args.group_size,
                    0,
                    None,
                    max_steps_off_policy=modes[mode],
                )
                trained_s = [r.metrics["time/step_trainer_s"] for r in reports]
                staleness = [r.metrics["steps_off_policy"] for r in reports]
                discarded = reports[-1].metrics["discarded_stale_groups"]
            wall = time.perf_counter() - started
            engine_idle = 1.0 - (gateway.busy_seconds() - busy) / wall
            success = await evaluate(model, args.eval_samples, seed=7919)
            rows.append(
                {
                    "mode": mode,
                    "step_s": wall / args.steps,
                    "engine_idle": engine_idle,
                    "trainer_idle": 1.0 - sum(trained_s) / wall,
                    "staleness": statistics.mean(staleness),
                    "success": success,
                    "samples": samples,
                    "discarded": discarded,
                }
            )
    finally:
        await backend.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--max-steps-off-policy", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    rows = asyncio.run(run(args))
    print(
        f"\nthe demo task, {args.steps} steps x 8 groups x {args.group_size} rollouts each way, tiny model, CPU\n"
    )
    print(
        "| mode | wall s/step | vs sync | engine idle | trainer idle | mean staleness | stale groups dropped | "
        "success after the same samples |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['step_s']:.2f} | {r['step_s'] / rows[0]['step_s']:.2f} | {r['engine_idle']:.1%} | "
            f"{r['trainer_idle']:.1%} | {r['staleness']:.2f} | {int(r['discarded'])} | "
            f"{r['success']:.3f} ({r['samples']} samples) |"
        )


if __name__ == "__main__":
    main()
