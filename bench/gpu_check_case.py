"""One case of bench/gpu_check.py, in its own process (the trainer's): a randomly initialized model of a real shape
built from its config on the GPU, the memory plan for it, one GRPO step with the plan's settings, the trainer's
offload/reload cycle, then ART's shared-GPU order for 3 steps beside a vLLM memory stand-in (bench/gpu_standin.py).

python bench/gpu_check_case.py --case qwen2.5-7b --out part.json [--dry-run] [--plan-json plans.json]

The JSON is rewritten after every phase, so a case killed at its time limit still reports what it measured.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.gpu_plan import Plan
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import TrajectoryGroup
from gpu_check_plan import LORA_RANK, against_plan, estimate, plan_for, standin_sizes
from gpu_models import CASES, DRY_CASES, Case, groups_for, model_folder, random_weights
from gpu_standin import Child, StandIn

GIB = 2**30
LORA = LoRAConfig(rank=LORA_RANK, alpha=2 * LORA_RANK)
SHARED_STEPS = 3


class Gauge:
    """Memory readings: the GPU's (the caching allocator's reserve, and the whole device's use), or on the CPU
    (a dry run) this process's resident set, which only shows that the sequence ran."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.total = torch.cuda.get_device_properties(device).total_memory if self.cuda else 0

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.cuda else _rss()

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else _rss()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def device_used(self) -> int:
        """Every process's use of the GPU (total - free); on the CPU this process's and its children's RSS."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free
        import psutil

        me = psutil.Process()
        return me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))

    def empty_cache(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def gib(value: float) -> float:
    return round(value / GIB, 4)


class Report:
    """The case's JSON, written after every phase; `event` logs the order the shared sequence ran in."""

    def __init__(self, path: Path, case: str) -> None:
        self.path, self.started = path, time.perf_counter()
        self.data: dict[str, Any] = {"case": case, "events": [], "error": None}

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        self.data["events"].append({"event": name, "step": step, "t": round(self.elapsed(), 3), **fields})

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


def build_trainer(folder: Path, plan: Plan, device: torch.device) -> tuple[Trainer, dict[str, Any]]:
    """The trainer with the plan's settings. Settings this checkout's Trainer lacks are reported, not faked."""
    accepted = inspect.signature(Trainer.__init__).parameters
    kwargs: dict[str, Any] = {
        "max_seq_len": plan.max_seq_len,
        "gradient_checkpointing": plan.gradient_checkpointing,
    }
    info: dict[str, Any] = {"engine": "peft", "gradient_checkpointing": plan.gradient_checkpointing}
    if "logprob_chunk_tokens" in accepted:
        kwargs["logprob_chunk_tokens"] = plan.logprob_chunk_tokens
        info["logprob_chunk_tokens"] = plan.logprob_chunk_tokens
    else:
        info["logprob_chunk_tokens"] = "not in this checkout's Trainer: logprobs unchunked"
    if plan.load_in_4bit:  # PEFT here has no bitsandbytes, and the weights are built in 16 bits
        raise RuntimeError(
            "the plan asks for a 4-bit trainer, which this check cannot build (no bitsandbytes)"
        )
    dtype = getattr(torch, plan.trainer_dtype) if device.type == "cuda" else None  # the CPU: float32
    info["dtype"] = str(dtype or torch.float32).removeprefix("torch.")
    with random_weights(device):
        trainer = Trainer(folder, LORA, engine="peft", device=str(device), dtype=dtype, **kwargs)
    base = trainer.model.get_base_model()
    info["load_s"] = round(trainer.load_seconds, 2)
    info["base_parameters"] = sum(
        p.numel() for p in base.parameters() if not p.requires_grad
    )  # LoRA's left out
    info["offload"] = (
        "Trainer.offload/reload" if hasattr(trainer, "offload") else "fallback in gpu_check_case"
    )
    return trainer, info


def move_trainer(trainer: Trainer, device: torch.device) -> None:
    """The fallback offload/reload for a checkout whose Trainer has none: the model and its optimizer state."""
    trainer.model.to(device)
    for state in trainer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):  # fused AdamW keeps even its step counts on the GPU
                state[key] = value.to(device)


def offload(trainer: Trainer) -> None:
    if hasattr(trainer, "offload"):
        trainer.offload()
    else:
        move_trainer(trainer, torch.device("cpu"))


def reload(trainer: Trainer) -> None:
    if hasattr(trainer, "reload"):
        trainer.reload()
    else:
        move_trainer(trainer, trainer.device)


# --- the sequence --------------------------------------------------------------------------------------------------


def timed(gauge: Gauge, work: Callable[[], Any]) -> tuple[Any, float]:
    gauge.sync()
    started = time.perf_counter()
    result = work()
    gauge.sync()
    return result, time.perf_counter() - started


def standalone_step(
    trainer: Trainer, groups: list[TrajectoryGroup], config: TrainConfig, gauge: Gauge
) -> dict[str, Any]:
    """A warm-up step (kernels, allocator), then the measured one from a reset peak."""
    _, warmup_s = timed(gauge, lambda: trainer.train_step(groups, config))
    warm_peak = gauge.peak_reserved()
    gauge.reset_peak()
    metrics, step_s = timed(gauge, lambda: trainer.train_step(groups, config))
    if "skipped_reason" in metrics:
        raise RuntimeError(f"the step trained nothing: {metrics['skipped_reason']}")
    tokens = sum(
        len(c.prompt_token_ids or []) + len(c.completion_token_ids or [])
        for g in groups
        for t in g
        for c in t.llm_calls
    )
    return {
        "warmup_s": round(warmup_s, 3),
        "step_s": round(step_s, 3),
        "tokens": tokens,
        "trained_tokens": int(metrics["trained_tokens"]),
        "truncated_tokens": int(metrics.get("truncated_tokens", 0)),
        "tokens_per_s": round(tokens / step_s, 1),
        "micro_batches": int(metrics["micro_batches"]),
        "loss": float(metrics["loss"]),
        "peak_reserved_gib": gib(gauge.peak_reserved()),
        "warmup_peak_reserved_gib": gib(warm_peak),
    }


def offload_cycle(trainer: Trainer, gauge: Gauge) -> dict[str, Any]:
    """Offload (+ empty_cache) and reload, each timed, with the reserve before and after."""
    gauge.empty_cache()
    before, used_before = gauge.reserved(), gauge.device_used()
    _, offload_s = timed(gauge, lambda: (offload(trainer), gauge.empty_cache()))
    after, used_after = gauge.reserved(), gauge.device_used()
    _, reload_s = timed(gauge, lambda: reload(trainer))
    return {
        "offload_s": round(offload_s, 3),
        "reload_s": round(reload_s, 3),
        "reserved_before_gib": gib(before),
        "reserved_after_offload_gib": gib(after),
        "freed_gib": gib(before - after),
        "device_used_before_gib": gib(used_before),
        "device_used_after_offload_gib": gib(used_after),
        "reserved_after_reload_gib": gib(gauge.reserved()),
    }


def shared_step(
    row: dict[str, Any],
    trainer: Trainer,
    standin: StandIn,
    groups: list[TrajectoryGroup],
    config: TrainConfig,
    gauge: Gauge,
    report: Report,
    save_dir: Path,
    used: Callable[[], float],
) -> None:
    """ART's order for step `row["step"]`: sleep, empty_cache, reload, train, save, offload, empty_cache, wake; its
    figures go into `row` as they come. A failure mid-step still offloads, empties the cache and wakes the engine
    (then re-raises)."""
    step = row["step"]

    def phase(name: str, work: Callable[[], Any]) -> Any:
        try:
            result, seconds = timed(gauge, work)
        except BaseException as error:
            report.event(name, step, error=f"{type(error).__name__}: {str(error)[:300]}")
            raise
        row[f"{name}_s"] = round(seconds, 3)
        report.event(name, step, device_used_gib=used())
        return result

    asleep = phase("sleep", lambda: standin.post("/sleep?level=1"))
    row["standin_asleep_bytes"] = asleep["held_bytes"]
    phase("empty_cache", gauge.empty_cache)
    try:
        phase("reload", lambda: reload(trainer))
        base = gauge.reserved()
        row["device_used_after_reload_gib"] = used()
        gauge.reset_peak()
        metrics = phase("step", lambda: trainer.train_step(groups, config))
        row["peak_reserved_gib"] = gib(gauge.peak_reserved())
        # The device's use at the step's peak: what it used after reload, plus the reserve the step grew by.
        row["device_peak_gib"] = round(
            row["device_used_after_reload_gib"] + gib(gauge.peak_reserved() - base), 3
        )
        row["trained_tokens"] = int(metrics["trained_tokens"])
        phase("save", lambda: trainer.save(save_dir / f"{step:04d}"))
    finally:
        phase("offload", lambda: offload(trainer))
        phase("empty_cache", gauge.empty_cache)
        row["device_used_trainer_offloaded_gib"] = used()
        row["trainer_reserved_offloaded_gib"] = gib(gauge.reserved())
        awake = phase("wake", lambda: standin.post("/wake_up"))
        row["standin_awake_bytes"] = awake["held_bytes"]
        row["device_used_awake_gib"] = used()


def start_ballast(card: int, case: Case, gauge: Gauge, scale: int, data: dict[str, Any]) -> Child:
    """A card of `card` bytes made of a larger GPU: this process capped to it (`set_per_process_memory_fraction`; the
    stand-in gets the same), and a ballast process holding the rest of the device's free memory, so that every
    process together fits in `card` or fails (a fraction alone caps each process, not their sum)."""
    fraction = min(1.0, card / gauge.total) if gauge.cuda else None
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, gauge.device)
    data["memory_fraction"] = fraction
    gauge.empty_cache()
    leave = card - gauge.device_used() if gauge.cuda else 0  # this process's context counts inside the card
    dry_bytes = int((79.2 - (case.card_gib or 0.0)) * scale)
    argv = [
        "ballast",
        "--device",
        str(gauge.device),
        "--leave-free-bytes",
        str(leave),
        "--bytes",
        str(dry_bytes),
    ]
    ballast = Child(argv, 120)
    data["ballast_gib"] = gib(ballast.ready["ballast_bytes"])
    return ballast


def start_standin(
    plan: Plan, case: Case, card: int, gauge: Gauge, scale: int, data: dict[str, Any]
) -> StandIn:
    sizes = standin_sizes(plan, case.config, data["trainer"]["base_parameters"] * 2, card)
    data["standin"] = {k + "_gib": gib(v) for k, v in sizes.items()}
    argv = ["--device", str(gauge.device)]
    for name in ("weights", "kv", "resident"):
        argv += [f"--{name}-bytes", str(sizes[name] * scale // GIB)]
    if data.get("memory_fraction") is not None:
        argv += ["--memory-fraction", str(data["memory_fraction"])]
    standin = StandIn(argv, 300)
    data["standin"]["start_s"] = round(standin.ready["start_s"], 3)
    data["standin"]["held_bytes"] = standin.ready["held_bytes"]
    return standin


def run_case(
    name: str, case: Case, device: torch.device, report: Report, work: Path, plans: dict[str, Any] | None
) -> None:
    """The case's phases in order; an error ends it (recorded, `fits` false) and the stand-ins are stopped."""
    gauge = Gauge(device)
    data = report.data
    card = int((case.card_gib or gauge.total / GIB) * GIB)
    data["device"] = torch.cuda.get_device_name(device) if gauge.cuda else "cpu (dry run)"
    data["card_gib"] = gib(card) if gauge.cuda else case.card_gib
    scale = GIB if gauge.cuda else 2**20  # the dry run allocates the plan's GiB as MiB
    children: list[Child] = []
    ballast_bytes = 0
    plan: Plan | None = None

    def used() -> float:
        return gib(gauge.device_used() - ballast_bytes)

    try:
        folder = model_folder(case.config, work)
        plan, data["plan_source"] = plan_for(name, case, folder, device, plans)
        data["plan"] = plan.model_dump()
        length = case.prompt_tokens + case.completion_tokens
        if plan.max_seq_len < length:
            raise RuntimeError(
                f"the plan's max_seq_len {plan.max_seq_len} is below this check's {length}-token rows"
            )
        report.event("plan")
        report.write()
        if case.capped:
            children.append(start_ballast(card, case, gauge, scale, data))
            ballast_bytes = int(children[-1].ready["ballast_bytes"]) if gauge.cuda else 0
            report.event("ballast", device_used_gib=used())
        trainer, data["trainer"] = build_trainer(folder, plan, device)
        report.event("trainer_loaded", device_used_gib=used())
        report.write()
        groups = groups_for(case, int(case.config["vocab_size"]) - 512)
        config = TrainConfig(
            loss="grpo",
            learning_rate=1e-5,
            max_seq_len=plan.max_seq_len,
            micro_batch_tokens=plan.micro_batch_tokens,
        )
        step = data["step"] = standalone_step(trainer, groups, config, gauge)
        step["plan_estimate_gib"] = estimate(plan, "trainer_step")
        report.event("standalone_step", device_used_gib=used())
        report.write()
        data["offload_cycle"] = offload_cycle(trainer, gauge)
        report.event("offload_cycle")
        offload(trainer)  # ART's order: the trainer loads first and leaves the GPU before vLLM starts
        gauge.empty_cache()
        report.event("offload", device_used_gib=used())
        children.append(standin := start_standin(plan, case, card, gauge, scale, data))
        report.event("standin_started", device_used_gib=used())
        report.write()
        rows: list[dict[str, Any]] = data.setdefault("shared_steps", [])
        with tempfile.TemporaryDirectory(prefix="gpu-check-save-") as save_dir:
            for index in range(1, SHARED_STEPS + 1):
                rows.append(row := {"step": index})
                shared_step(row, trainer, standin, groups, config, gauge, report, Path(save_dir), used)
                report.write()
        most = max(max(r["device_peak_gib"], r["device_used_awake_gib"]) for r in rows)
        data["fits"] = not gauge.cuda or most <= gib(card)
    except Exception as error:
        data["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
        data["fits"] = False
        traceback.print_exc()
    finally:
        for child in reversed(children):
            child.close()
        rows = data.get("shared_steps", [])
        peaks = [r[k] for r in rows for k in ("device_peak_gib", "device_used_awake_gib") if k in r]
        data["max_device_used_gib"] = max(peaks, default=None)
        if plan is not None:
            data["against_plan"] = against_plan(plan, data)
        report.event("done")
        report.write()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--out", required=True, help="the case's JSON")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes, the plan's GiB as MiB")
    parser.add_argument("--plan-json", help="plans by case name, instead of make_plan's")
    args = parser.parse_args()
    cases = DRY_CASES if args.dry_run else CASES
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: bench/gpu_check.py --dry-run runs the same sequence on the CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    plans = json.loads(Path(args.plan_json).read_text()) if args.plan_json else None
    report = Report(Path(args.out), args.case)
    report.data["dry_run"] = args.dry_run
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        run_case(args.case, cases[args.case], device, report, Path(work), plans)


if __name__ == "__main__":
    main()
