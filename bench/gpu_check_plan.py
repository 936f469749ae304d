"""The plan's side of bench/gpu_check.py: the plan for a case's card (`make_plan`, or `--plan-json`), what the vLLM
stand-in holds under it, and each measure set beside the plan's estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from art_adapters.gpu_plan import GPUs, Plan, make_plan
from gpu_models import Case

GIB = 2**30
LORA_RANK = 16

# The plan's estimates (gpu_plan's keys) each measure is set against: the trainer process's peak reserve in a step
# is its weights, LoRA state, activations and logits (its CUDA context is outside the allocator's reserve); the
# device's use at a shared step's peak is the training phase; with the engine awake, the inference phase.
COMPARED: dict[str, tuple[str, ...]] = {
    "trainer_step": ("trainer_weights", "lora_optimizer", "activations", "logits"),
    "training_phase": ("training_total",),
    "inference_phase": ("inference_phase_total",),
}
VLLM_ASLEEP_KEYS = ("vllm_asleep",)


def plan_for(
    case_name: str, case: Case, folder: Path, device: torch.device, plans: dict[str, Any] | None
) -> tuple[Plan, str]:
    """The plan from `make_plan` for this card, or the one `--plan-json` gives for this case."""
    if plans is not None and case_name in plans:
        return Plan.model_validate(plans[case_name]), "--plan-json"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = case.card_gib or props.total_memory / GIB
        capability = case.capability or (props.major, props.minor)
        gpus = GPUs(count=1, memory_gib=memory, capability=capability, name=props.name)
    else:
        assert case.card_gib is not None and case.capability is not None
        gpus = GPUs(count=1, memory_gib=case.card_gib, capability=case.capability, name="dry run")
    tokens = case.sequences * (case.prompt_tokens + case.completion_tokens)
    try:
        plan = make_plan(
            folder, gpus, max_seq_len=case.max_seq_len, lora_rank=LORA_RANK, tokens_per_step=tokens
        )
    except NotImplementedError:
        raise RuntimeError(
            "make_plan is not implemented on this checkout: give the plans with --plan-json FILE "
            '({"CASE": {Plan fields}, ...})'
        ) from None
    return plan, "make_plan"


def standin_sizes(plan: Plan, config: dict[str, Any], weights_bytes: int, card_bytes: int) -> dict[str, int]:
    """What vLLM would hold under the plan: its share of the card (utilization × memory) as the bf16 weights, the
    KV cache for `kv_cache_tokens`, and the rest (graphs, activations, slack). Sleep releases the weights and KV
    cache; the rest stays, except what the plan says an asleep engine releases too (its `vllm_asleep` estimate)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    kv = plan.kv_cache_tokens * kv_per_token
    share = int(plan.gpu_memory_utilization * card_bytes)
    rest = max(0, share - weights_bytes - kv)
    asleep = next((plan.estimates_gib[k] for k in VLLM_ASLEEP_KEYS if k in plan.estimates_gib), None)
    resident = rest if asleep is None else min(rest, int(asleep * GIB))
    return {"weights": weights_bytes, "kv": kv + rest - resident, "resident": resident, "share": share}


def estimate(plan: Plan, what: str) -> float | None:
    """The plan's estimate (GiB) for one of COMPARED's measures; None when the plan gives no such estimate."""
    keys = COMPARED[what]
    if not all(key in plan.estimates_gib for key in keys):
        return None
    return round(sum(plan.estimates_gib[key] for key in keys), 3)


def against_plan(plan: Plan, data: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each measure beside the plan's estimate, and their ratio (above 1: the plan under-estimates)."""
    rows = data.get("shared_steps", [])
    measured = {
        "trainer_step": data.get("step", {}).get("peak_reserved_gib"),
        "training_phase": max((r["device_peak_gib"] for r in rows if "device_peak_gib" in r), default=None),
        "inference_phase": max(
            (r["device_used_awake_gib"] for r in rows if "device_used_awake_gib" in r), default=None
        ),
    }
    out: dict[str, dict[str, float | None]] = {}
    for what, value in measured.items():
        planned = estimate(plan, what)
        ratio = round(value / planned, 3) if value is not None and planned else None
        out[what] = {"measured_gib": value, "plan_gib": planned, "measured_over_plan": ratio}
    return out
