"""Sync vs async training on the same workload and sample budget, in one run: the demo's first task
(demo/tool_choice.py: the tiny model, one warm start per seed shared by every mode), S steps of 8 scenario groups x
G rollouts each way, then the same evaluation; repeated over seeds (success: mean and spread).

Engine idle = the share of the run's wall time with no request in flight at the engine (from its gateway); trainer
idle = the share not spent in training steps; staleness = trained step - the version that sampled (mean per group).
Usage: python bench/async_pipeline.py [--steps 8] [--group-size 8] [--seeds 3] [--max-steps-off-policy 1 2]
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
    from art_adapters.inference import InferenceConfig

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    backend = art.LocalBackend(root, inference=InferenceConfig(max_model_len=1024, max_lora_rank=16))
    rows: list[dict[str, Any]] = []
    try:
        for seed in range(args.seeds):
            rows += await run_seed(args, backend, seed)
    finally:
        await backend.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


async def run_seed(args: argparse.Namespace, backend: Any, seed: int) -> list[dict[str, Any]]:
    """Every mode once, from the same warm start and on the same rollout seeds."""
    import art_adapters as art
    from art_adapters.demo.tool_choice import (
        SCENARIOS,
        evaluate,
        scenario_groups,
        train_demo_async,
        warm_start_examples,
    )
    from art_adapters.tiny import tiny_model_path

    lora = art.LoRAConfig(rank=16, alpha=32)
    modes = {"sync": 0, **{f"async, <= {k} step off-policy": k for k in args.max_steps_off_policy}}
    base = str(tiny_model_path())
    models = {
        mode: art.TrainableModel(name=f"agent-{seed}-{i}", project="bench", base_model=base, lora=lora)
        for i, mode in enumerate(modes)
    }
    rows: list[dict[str, Any]] = []
    await models["sync"].register(backend)
    await models["sync"].train_sft(
        warm_start_examples(64, seed),
        config=art.SFTConfig(learning_rate=5e-3, epochs=32, batch_size=16, seed=seed),
    )
    for mode, model in models.items():  # the very same warm start (its checkpoint, optimizer state included)
        if mode != "sync":
            warm = backend.model_dir(models["sync"]) / "checkpoints"
            shutil.copytree(warm, backend.model_dir(model) / "checkpoints")
            await model.register(backend)
    gateway = next(iter(backend._models.values())).gateway
    config = art.TrainConfig(learning_rate=args.learning_rate, seed=seed)
    samples = args.steps * len(SCENARIOS) * args.group_size
    for mode, model in models.items():
        trained_s: list[float] = []
        staleness: list[float] = []
        discarded = 0.0
        busy, started = gateway.busy_seconds(), time.perf_counter()
        if mode == "sync":
            for k in range(args.steps):  # the seeds train_demo_async gives step k's groups
                groups = await art.gather_trajectory_groups(
                    scenario_groups(model, args.group_size, (seed + 1) * 1_000_003 + k * 10_007),
                    pbar_desc=None,
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
                seed,
                None,
                max_steps_off_policy=modes[mode],
            )
            trained_s = [r.metrics["time/step_trainer_s"] for r in reports]
            staleness = [r.metrics["steps_off_policy"] for r in reports]
            discarded = reports[-1].metrics["discarded_stale_groups"]
        wall = time.perf_counter() - started
        engine_idle = 1.0 - (gateway.busy_seconds() - busy) / wall
        success = await evaluate(model, args.eval_samples, seed=7919 + seed)
        rows.append(
            {
                "seed": seed,
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
        print(f"  seed {seed} {mode}: success {success:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--max-steps-off-policy", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    rows = asyncio.run(run(args))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    sync = [r["success"] for r in rows if r["mode"] == "sync"]
    print(
        f"\nthe demo task, {args.steps} steps x 8 groups x {args.group_size} rollouts each way, lr "
        f"{args.learning_rate:g}, tiny model, CPU, {args.seeds} seeds (success: mean +- sd over seeds)\n"
    )
    print(
        "| mode | wall s/step | vs sync | engine idle | trainer idle | mean staleness | stale groups dropped | "
        "success after the same samples | vs sync |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_step = statistics.mean(r["step_s"] for r in rows if r["mode"] == "sync")
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        success = [r["success"] for r in mine]
        step_s = statistics.mean(r["step_s"] for r in mine)
        spread = statistics.stdev(success) if len(success) > 1 else 0.0
        print(
            f"| {mode} | {step_s:.2f} | {step_s / base_step:.2f} | "
            f"{statistics.mean(r['engine_idle'] for r in mine):.1%} | "
            f"{statistics.mean(r['trainer_idle'] for r in mine):.1%} | "
            f"{statistics.mean(r['staleness'] for r in mine):.2f} | {sum(int(r['discarded']) for r in mine)} | "
            f"{statistics.mean(success):.3f} +- {spread:.3f} ({mine[0]['samples']} samples) | "
            f"{statistics.mean(success) - statistics.mean(sync):+.3f} |"
        )


if __name__ == "__main__":
    main()
