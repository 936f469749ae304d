"""Where a LocalBackend's trainer and engine run on CUDA: the memory plan (`gpu_plan.make_plan`) as the default of
every setting the user left unset, GPU ids checked against the GPUs this process sees, and shared or dedicated
placement decided before anything loads."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..devices import check_gpu_ids

if TYPE_CHECKING:
    from ..gpu_plan import Plan
    from ..inference import InferenceConfig
    from ..model import TrainableModel

log = logging.getLogger("art_adapters.backend.local")

# The InferenceConfig fields a plan decides (when the user did not set them), and the plan's field for each.
PLANNED_ENGINE_FIELDS = {
    "max_model_len": "max_seq_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enable_sleep_mode": "enable_sleep_mode",
    "tensor_parallel_size": "tensor_parallel_size",
    "replicas": "replicas",
    "gpu_ids": "inference_gpu_ids",
}


def placement_of(
    trainer_gpus: list[int], engine_gpus: list[int] | None, planned: str | None = None
) -> Literal["shared", "dedicated"]:
    """Dedicated when trainer and engine have GPUs of their own; shared when they use the same GPUs (or either
    is left to its default). GPUs that partly overlap are shared only where the plan says so; otherwise a
    ValueError (the engine would sleep for a trainer that is mostly elsewhere, or run beside one it never
    yields to)."""
    trainer, engine = set(trainer_gpus), set(engine_gpus or [])
    if not trainer or not engine or trainer == engine:
        return "shared"
    if not trainer & engine:
        return "dedicated"
    if planned == "shared":
        return "shared"
    raise ValueError(
        f"the trainer's GPUs {sorted(trainer)} partly overlap the inference GPUs {sorted(engine)}: give them "
        "GPUs of their own (dedicated) or the very same GPUs (shared, the engine sleeping during each step)"
    )


def check_ids(trainer_gpus: list[int], engine_gpus: list[int] | None, count: int) -> None:
    """GPU ids this process cannot see: a clear error before anything loads."""
    check_gpu_ids("trainer GPU ids", trainer_gpus, count)
    check_gpu_ids("inference GPU ids", list(engine_gpus or []), count)


def make_engine_plan(
    base: Path, model: TrainableModel, config: InferenceConfig, trainer_gpus: list[int]
) -> Plan | None:
    """The memory plan for `base` on the visible GPUs, every setting the user gave passed as an override (None
    without CUDA: the CPU keeps its own defaults). A plan that cannot fit raises PlanError, before anything loads."""
    from ..gpu_plan import GPUs, make_plan

    gpus = GPUs.detect()
    if gpus is None:
        return None
    given = config.model_fields_set
    return make_plan(
        base,
        gpus,
        max_seq_len=config.max_model_len if "max_model_len" in given else None,
        lora_rank=model.lora.rank,
        trainer_gpu_ids=list(trainer_gpus) or None,
        inference_gpu_ids=list(config.gpu_ids) if config.gpu_ids else None,
        tensor_parallel_size=config.tensor_parallel_size
        if config.gpu_ids or "tensor_parallel_size" in given
        else None,
        replicas=config.replicas if config.gpu_ids or "replicas" in given else None,
        gpu_memory_utilization=config.gpu_memory_utilization if "gpu_memory_utilization" in given else None,
    )


def planned_config(config: InferenceConfig, plan: Plan) -> InferenceConfig:
    """`config` with the plan's value for each engine setting the user left unset (on CPU plans, none)."""
    from ..inference import InferenceConfig

    given = config.model_fields_set
    updates: dict[str, Any] = {
        field: getattr(plan, source) for field, source in PLANNED_ENGINE_FIELDS.items() if field not in given
    }
    if not plan.inference_gpu_ids:
        updates.pop("gpu_ids", None)
    if "gpu_ids" in given:  # the GPUs given decide replicas x TP (the plan was asked with them)
        updates.pop("replicas", None)
        updates.pop("tensor_parallel_size", None)
    if plan.placement == "cpu":
        return config
    return InferenceConfig.model_validate({**config.model_dump(exclude_unset=True), **updates})


def trainer_settings(plan: Plan | None, trainer_class: type) -> dict[str, Any]:
    """The Trainer keywords the plan decides: its sequence length, checkpointing and dtype, and (where this
    Trainer takes them) its logprob chunk, 4-bit base and micro-batch budget (a cap on TrainConfig's)."""
    if plan is None or plan.placement == "cpu":
        return {}
    import torch

    settings: dict[str, Any] = {
        "max_seq_len": plan.max_seq_len,
        "gradient_checkpointing": plan.gradient_checkpointing,
        "dtype": getattr(torch, plan.trainer_dtype),
        "logprob_chunk_tokens": plan.logprob_chunk_tokens,
        "load_in_4bit": plan.load_in_4bit,
        "micro_batch_tokens": plan.micro_batch_tokens,
    }
    parameters = inspect.signature(trainer_class).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = set(settings) if takes_any else set(parameters)
    if plan.load_in_4bit and "load_in_4bit" not in accepted:
        raise ValueError("the plan asks for a 4-bit trainer, which this Trainer cannot load")
    return {name: value for name, value in settings.items() if name in accepted}


def cuda_engine_config(
    config: InferenceConfig,
    base: Path,
    model: TrainableModel,
    given: list[int],
    processes: int,
    given_fields: set[str],
    devices: int,
) -> tuple[InferenceConfig, Plan | None]:
    """LocalBackend's engine settings on CUDA: the installed versions checked, the GPU ids checked against the
    `devices` this process sees, and the memory plan's decision for each setting the user left unset
    (`given_fields`); a plan that cannot fit raises PlanError here, before anything loads."""
    from .stack import check_cuda_stack

    check_cuda_stack()
    check_ids(given, config.gpu_ids, devices)
    trainer = given or (list(range(processes)) if processes > 1 else [])
    plan = make_engine_plan(base, model, config, trainer)
    if plan is None:
        return config, None
    config = planned_config(config, plan)
    check_ids(plan.trainer_gpu_ids, config.gpu_ids, devices)
    trainer = given or list(plan.trainer_gpu_ids)
    dedicated = placement_of(trainer, config.gpu_ids, plan.placement) == "dedicated"
    given_sleep = "enable_sleep_mode" in given_fields
    if not dedicated and given_sleep and not config.sleep_mode_enabled(True):
        raise ValueError(
            "enable_sleep_mode=False, but the trainer shares the engine's GPU: the engine must sleep while a "
            "step trains; give the engine GPUs of its own (inference gpu_ids) or leave enable_sleep_mode unset"
        )
    if dedicated and not given_sleep:
        config = config.model_copy(update={"enable_sleep_mode": False})  # GPUs of its own: it never sleeps
    log.info(
        "memory plan for %s: %s, trainer GPUs %s, inference GPUs %s (TP %d x %d replicas, util %.2f), "
        "max_seq_len %d",
        base.name,
        plan.placement,
        plan.trainer_gpu_ids,
        config.gpu_ids,
        config.tensor_parallel_size,
        config.replicas,
        config.gpu_memory_utilization,
        config.max_model_len,
    )
    return config, plan
