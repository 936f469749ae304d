"""The GPU acceptance check (`make gpu-check`): the memory plan, the trainer and ART's shared-GPU order on one GPU,
within 8 minutes on one H100, with only torch, transformers, peft and this package (no vLLM, no Unsloth, no
download: the models are Qwen2.5 shapes built from their public configs, randomly initialized on the GPU).

Per case, in a process of its own (bench/gpu_check_case.py; a crash or an out-of-memory in one leaves the other):
- qwen2.5-7b on the GPU as it is (80 GB): one GRPO step on 8 × 3.5k-token sequences with the plan's settings
  (gradient checkpointing, logprob chunks, micro-batch tokens): step time, tokens/s, peak reserved memory against
  the plan's estimate; the trainer's offload/reload cycle (time, memory freed); then a vLLM memory stand-in
  (bench/gpu_standin.py: real allocations of the plan's weights and KV cache, released on /sleep and retaken on
  /wake_up) and 3 steps in ART's order (sleep, empty_cache, reload, step, save, offload, empty_cache, wake).
- qwen2.5-3b-24gb: the same, on a 24 GB card made of the GPU: each process capped by
  `set_per_process_memory_fraction` and a ballast process holding the rest, so the two processes together fit
  in 23.6 GiB or fail.

Writes OUT/gpu_check.json (one entry per case, each case's log beside it) and prints a table; exits 1 when a case
fails or the run overruns its budget. `--dry-run` runs the same sequence on the CPU (tiny shapes, the plan's GiB
allocated as MiB) to test the logic; tests/test_gpu_check.py runs it.

The measurements that were here before (the sampler/trainer logprob gap, FSDP2 on 1 and 2 processes) need more
than the 8 minutes beside this; they are in bench/gpu_fidelity.py.

python bench/gpu_check.py [--out DIR] [--cases qwen2.5-7b,qwen2.5-3b-24gb] [--dry-run] [--plan-json FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASE_SCRIPT = Path(__file__).with_name("gpu_check_case.py")
CASES = ("qwen2.5-7b", "qwen2.5-3b-24gb")
BUDGET_S = 480.0  # the bound for one H100
DRY_RUN_BUDGET_S = 1200.0  # the CPU dry run proves the logic, not the time; a loaded 2-core machine is slow
LATER_CASE_RESERVE_S = 150.0  # kept for each case still to run when an earlier one overruns


def run_case(name: str, args: argparse.Namespace, out: Path, timeout_s: float) -> dict[str, Any]:
    """The case in its own process, bounded by timeout_s (its whole process group is killed past it)."""
    part = out / f"{name}.json"
    part.unlink(missing_ok=True)
    argv = [sys.executable, str(CASE_SCRIPT), "--case", name, "--out", str(part)]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--plan-json", args.plan_json] if args.plan_json else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:  # tiny shapes: one thread each, no spinning OpenMP workers between the processes
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout_s)
            error = None if code == 0 else f"the case's process exited with {code} (see {name}.log)"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
            error = f"timed out after {timeout_s:.0f} s (what it measured before is kept)"
    result: dict[str, Any] = json.loads(part.read_text()) if part.exists() else {"case": name, "events": []}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if error and not result.get("error"):
        result["error"] = error
    if error:
        result["fits"] = False
    return result


def plan_json_problem(path: Path, cases: list[str]) -> str | None:
    """What is wrong with a --plan-json file, checked before any case starts (None: nothing)."""
    from pydantic import ValidationError

    from art_adapters.gpu_plan import Plan

    try:
        plans = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return f"cannot read it as JSON ({error})"
    if not isinstance(plans, dict):
        return 'not an object of plans by case ({"CASE": {Plan fields}})'
    strangers = sorted(set(plans) - set(CASES))
    if strangers:
        return f"{strangers} are not cases (cases: {', '.join(CASES)})"
    for name in cases:
        if name in plans:
            try:
                Plan.model_validate(plans[name])
            except ValidationError as error:
                return f"the plan for {name} is not a Plan: {error}"
    return None


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "peft"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


def cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(report: dict[str, Any]) -> str:
    """The summary as Markdown (pastes into docs/benchmarks.md)."""
    head = report["cases"][0].get("device", "?") if report["cases"] else "?"
    lines = [
        f"GPU check on {head}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f"; {report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget"
        + (" (CPU dry run: memory figures are process RSS, stand-in sizes in MiB for GiB)" if report["dry_run"] else ""),
        "",
        "| case | card GiB | vLLM util | KV tokens | ckpt | logprob chunk | step s | tokens/s | peak reserved GiB "
        "| plan GiB | offload s | reload s | freed GiB | shared: max device GiB | steps | fits |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for case in report["cases"]:
        plan, step, cycle = case.get("plan", {}), case.get("step", {}), case.get("offload_cycle", {})
        chunk = case.get("trainer", {}).get("logprob_chunk_tokens")
        lines.append(
            "| "
            + " | ".join(
                cell(v)
                for v in (
                    case["case"],
                    case.get("card_gib"),
                    plan.get("gpu_memory_utilization"),
                    plan.get("kv_cache_tokens"),
                    plan.get("gradient_checkpointing"),
                    "unchunked" if isinstance(chunk, str) else chunk,
                    step.get("step_s"),
                    step.get("tokens_per_s"),
                    step.get("peak_reserved_gib"),
                    step.get("plan_estimate_gib"),
                    cycle.get("offload_s"),
                    cycle.get("reload_s"),
                    cycle.get("freed_gib"),
                    case.get("max_device_used_gib"),
                    sum("save_s" in r and "wake_s" in r for r in case.get("shared_steps", [])),
                    case.get("fits"),
                )
            )
            + " |"
        )
    phases = ("sleep", "reload", "step", "save", "offload", "wake")
    lines += ["", "| case | shared step | " + " | ".join(f"{p} s" for p in phases) + " | device peak GiB |"]
    lines.append("|---|---:|" + "---:|" * (len(phases) + 1))
    for case in report["cases"]:
        for row in case.get("shared_steps", []):
            timings = " | ".join(cell(row.get(f"{p}_s")) for p in phases)
            lines.append(
                f"| {case['case']} | {row['step']} | {timings} | {cell(row.get('device_peak_gib'))} |"
            )
    lines += [
        "",
        "| case | measured / plan GiB: trainer step (reserved) | training phase (device) | inference phase (device) |",
    ]
    lines.append("|---|---:|---:|---:|")
    for case in report["cases"]:
        compared = case.get("against_plan", {})
        cells = [
            f"{cell(c.get('measured_gib'))} / {cell(c.get('plan_gib'))}"
            for c in (compared.get(k, {}) for k in ("trainer_step", "training_phase", "inference_phase"))
        ]
        lines.append(f"| {case['case']} | " + " | ".join(cells) + " |")
    for case in report["cases"]:
        if case.get("error"):
            lines.append(f"\n{case['case']}: ERROR {case['error']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="build/gpu-check", help="folder for gpu_check.json and the logs")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument(
        "--dry-run", "--cpu", action="store_true", help="the same sequence on the CPU, tiny shapes"
    )
    parser.add_argument("--plan-json", help='plans by case, instead of make_plan\'s: {"CASE": {Plan fields}}')
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"the whole run's bound (default {BUDGET_S:.0f} s; {DRY_RUN_BUDGET_S:.0f} dry)",
    )
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    if args.plan_json:
        problem = plan_json_problem(Path(args.plan_json), cases)
        if problem:
            parser.error(f"--plan-json {args.plan_json}: {problem}")
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else BUDGET_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    for index, name in enumerate(cases):
        left = args.budget_s - (time.perf_counter() - started)
        timeout = max(60.0, left - LATER_CASE_RESERVE_S * (len(cases) - index - 1))
        results.append(run_case(name, args, out, timeout))
    total = time.perf_counter() - started
    report = {
        "dry_run": args.dry_run,
        "versions": versions(),
        "budget_s": args.budget_s,
        "total_s": round(total, 1),
        "within_budget": total <= args.budget_s,
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "cases": results,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"\nwrote {out / 'gpu_check.json'}")
    ok = report["within_budget"] and all(case.get("fits") for case in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
