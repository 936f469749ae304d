"""Sync vs async training on the same workload and sample budget, in one run: the demo's first task
(demo/tool_choice.py: the tiny model, one warm start per seed shared by every mode), S steps of 8 scenario groups x
G rollouts each way, then the same evaluation; repeated over seeds (success: mean and spread).

Engine idle = the share of the run's wall time with no request in flight at the engine (from its gateway); trainer
idle = the share not spent in training steps; staleness = trained step - the version that sampled (mean per group).
`--guard D` adds each mode again with the step guard (TrainConfig(max_token_drop=D)); `--sign-aware` adds the TOPR
weight. Arms share seeds, so differences are paired: the table gives each arm's mean paired difference to sync with a
95 % t-interval over seeds, the runs that collapsed (success below `--collapse-below`) and how often the guard bound.
Usage: python bench/async_pipeline.py [--steps 16] [--group-size 8] [--seeds 8] [--eval-samples 32]
       [--max-steps-off-policy 2] [--guard 0.3] [--json rows.json] [--seed-offset 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    return await over_seeds(args, run_seed, "bench-async-")


async def over_seeds(
    args: argparse.Namespace, run_seed: Any, prefix: str, on_seed: Any = None
) -> list[dict[str, Any]]:
    """`run_seed(args, backend, seed)` for each of the run's seeds on one LocalBackend in a temporary folder;
    `on_seed(rows)` after each (save them: a later seed's failure then loses only that seed)."""
    import art_adapters as art
    from art_adapters.inference import InferenceConfig

    root = Path(tempfile.mkdtemp(prefix=prefix))
    backend = art.LocalBackend(root, inference=InferenceConfig(max_model_len=1024, max_lora_rank=16))
    rows: list[dict[str, Any]] = []
    try:
        for seed in range(args.seed_offset, args.seed_offset + args.seeds):
            seed_rows = await run_seed(args, backend, seed)
            rows += seed_rows
            if on_seed is not None:
                on_seed(seed_rows)
    finally:
        await backend.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


async def run_seed(args: argparse.Namespace, backend: Any, seed: int) -> list[dict[str, Any]]:
    """Every mode once, from the same warm start and on the same rollout seeds."""
    import art_adapters as art
    from art_adapters import checkpoints
    from art_adapters.demo.tool_choice import (
        SCENARIOS,
        evaluate,
        scenario_groups,
        train_demo_async,
        warm_start_examples,
    )
    from art_adapters.tiny import tiny_model_path

    lora = art.LoRAConfig(rank=16, alpha=32)
    modes = arms(args)
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
    samples = args.steps * len(SCENARIOS) * args.group_size
    for mode, model in models.items():
        steps_off, settings = modes[mode]
        config = art.TrainConfig(learning_rate=args.learning_rate, seed=seed, **settings)
        trained_s: list[float] = []
        staleness: list[float] = []
        discarded = 0.0
        busy, started = gateway.busy_seconds(), time.perf_counter()
        if steps_off == 0:
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
                max_steps_off_policy=steps_off,
            )
            trained_s = [r.metrics["time/step_trainer_s"] for r in reports]
            staleness = [r.metrics["steps_off_policy"] for r in reports]
            discarded = reports[-1].metrics["discarded_stale_groups"]
        wall = time.perf_counter() - started
        engine_idle = 1.0 - (gateway.busy_seconds() - busy) / wall
        success = await evaluate(model, args.eval_samples, seed=7919 + seed)
        if steps_off == 0:  # model.train's rows; the pipeline's step reports carry the trainer's metrics
            history = [
                row
                for row in checkpoints.read_history(backend.model_dir(model))
                if row.get("split") == "train" and "loss" in row
            ]
        else:
            history = [r.metrics for r in reports if "loss" in r.metrics]
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
                "guarded_steps": sum(int(r.get("guarded", 0)) for r in history),
                "trained_steps": len(history),
                "max_token_drop": max((float(r.get("max_token_drop", 0.0)) for r in history), default=0.0),
            }
        )
        print(f"  seed {seed} {mode}: success {success:.3f}", flush=True)
    return rows


def arms(args: argparse.Namespace) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each arm's name: its bound on steps off-policy (0 = sync) and its TrainConfig settings."""
    bounds = {"sync": 0, **{f"<= {k} off-policy": k for k in args.max_steps_off_policy}}
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for name, k in bounds.items():
        out[name] = (k, {"measure_token_drop": True})
        if args.guard is not None:
            out[f"{name} + guard {args.guard:g}"] = (k, {"max_token_drop": args.guard})
        if args.sign_aware and k > 0:
            out[f"{name} + sign-aware"] = (k, {"behaviour_weight": "sign_aware", "measure_token_drop": True})
    return out


# Student's t, two-sided 95 %, for 1-30 degrees of freedom (to 4 decimals)
T95 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
       2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
       2.0518, 2.0484, 2.0452, 2.0423]  # fmt: skip


def t95(df: int) -> float:
    """The t quantile; past 30 degrees of freedom its Cornish-Fisher expansion around the normal one."""
    if df <= len(T95):
        return T95[df - 1]
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t-interval of paired differences (one per seed)."""
    n = len(differences)
    mean = statistics.mean(differences)
    if n < 2:
        return mean, float("nan"), float("nan")
    half = t95(n - 1) * statistics.stdev(differences) / n**0.5
    return mean, mean - half, mean + half


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Add `rows` to a --json file (either shape), written whole to a temporary file and renamed over it."""
    saved = json.loads(path.read_text()) if path.exists() else []
    rows_of(saved).extend(rows)
    scratch = path.with_name(path.name + ".partial")
    scratch.write_text(json.dumps(saved, indent=1))
    scratch.replace(path)


def rows_of(saved: Any) -> list[dict[str, Any]]:
    """A --json file's rows: a list, or an object that keeps them beside how they were made ({"rows": [...]})."""
    return saved["rows"] if isinstance(saved, dict) else saved


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The paired table: each arm against sync on the same seeds."""
    arms_seen = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["mode"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    print(
        "\n| arm | success (mean over seeds) | paired diff vs sync [95 % CI] | collapsed | guard bound (steps) |"
    )
    print("|---|---:|---:|---:|---:|")
    for arm in arms_seen:
        paired = [s for s in seeds if (arm, s) in by and ("sync", s) in by]
        success = [by[(arm, s)]["success"] for s in seeds if (arm, s) in by]
        diffs = [by[(arm, s)]["success"] - by[("sync", s)]["success"] for s in paired]
        mean, low, high = paired_interval(diffs) if diffs else (float("nan"),) * 3
        collapsed = sum(v < args.collapse_below for v in success)
        bound = sum(by[(arm, s)]["guarded_steps"] for s in seeds if (arm, s) in by)
        steps = sum(by[(arm, s)]["trained_steps"] for s in seeds if (arm, s) in by)
        interval = "" if arm == "sync" else f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"
        print(
            f"| {arm} | {statistics.mean(success):.3f} ({len(success)} seeds) | {interval} | "
            f"{collapsed}/{len(success)} | {bound}/{steps} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--max-steps-off-policy", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--guard", type=float, default=None, help="also run each arm with max_token_drop=D")
    parser.add_argument("--sign-aware", action="store_true", help="also run the async arms with TOPR weights")
    parser.add_argument(
        "--collapse-below", type=float, default=0.25, help="a run ending below this collapsed"
    )
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed (split a long run in parts)")
    parser.add_argument("--json", default=None, help="also write the rows here (appends to an existing file)")
    parser.add_argument("--summarize", default=None, help="only print the tables of a --json file")
    args = parser.parse_args()
    if args.summarize:
        summarize(rows_of(json.loads(Path(args.summarize).read_text())), args)
        return
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    rows = asyncio.run(run(args))
    if args.json:
        path = Path(args.json)
        append_rows(path, rows)  # beside whatever the file says of how they were made
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
    summarize(rows, args)


if __name__ == "__main__":
    main()
