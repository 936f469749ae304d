"""What make_plan was asked (None meaning 'decide'), and its checks: each bad setting refused with its name and
why, before any estimate is made and before anything loads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gpu_plan import GPUs, ModelShape, Placement, PlanError


@dataclass(frozen=True)
class Request:
    """make_plan's arguments, None meaning 'decide'."""

    name: str
    shape: ModelShape
    gpus: GPUs | None
    max_seq_len: int | None = None
    lora_rank: int = 16
    tokens_per_step: int | None = None
    micro_batch_tokens: int | None = None
    placement: Placement | None = None
    trainer_gpu_ids: list[int] | None = None
    inference_gpu_ids: list[int] | None = None
    tensor_parallel_size: int | None = None
    replicas: int | None = None
    gpu_memory_utilization: float | None = None
    load_in_4bit: bool | None = None
    gradient_checkpointing: bool | None = None
    logprob_chunk_tokens: int | None = None


def check_request(r: Request) -> None:
    counts = ("max_seq_len", "tokens_per_step", "micro_batch_tokens", "logprob_chunk_tokens", "lora_rank")
    for key in (*counts, "tensor_parallel_size", "replicas"):
        value = getattr(r, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise PlanError(f"{key} must be a positive integer, got {value!r}")
    if r.max_seq_len is not None and r.max_seq_len > r.shape.context:
        raise PlanError(
            f"max_seq_len {r.max_seq_len} exceeds {r.name}'s context ({r.shape.context}, max_position_embeddings)"
        )
    util = r.gpu_memory_utilization
    if util is not None and not 0 < util < 1:
        raise PlanError(f"gpu_memory_utilization must be between 0 and 1 (exclusive), got {util}")
    cpu = r.gpus is None or r.placement == "cpu"
    if r.gpus is None and r.placement in ("shared", "dedicated"):
        raise PlanError(f"placement {r.placement!r} needs GPUs, and none were found or given")
    if r.gpus is not None and (
        r.gpus.count < 1 or not math.isfinite(r.gpus.memory_gib) or r.gpus.memory_gib <= 0
    ):
        raise PlanError(f"GPUs must be at least one with a finite memory > 0 GiB, got {r.gpus}")
    if cpu:
        gpu_only = {
            "trainer_gpu_ids": r.trainer_gpu_ids,
            "inference_gpu_ids": r.inference_gpu_ids,
            "tensor_parallel_size": r.tensor_parallel_size,
            "replicas": r.replicas,
            "gpu_memory_utilization": r.gpu_memory_utilization,
            "load_in_4bit": r.load_in_4bit or None,
        }
        given = [k for k, v in gpu_only.items() if v is not None]
        if given:
            raise PlanError(
                f"{', '.join(given)}: GPU settings, but the plan is for the CPU (no GPU found or given)"
            )
        return
    assert r.gpus is not None
    for key in ("trainer_gpu_ids", "inference_gpu_ids"):
        ids = getattr(r, key)
        if ids is None:
            continue
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < r.gpus.count]
        if bad or not ids or len(set(ids)) != len(ids):
            raise PlanError(
                f"{key} {ids}: each must be a distinct GPU id in 0..{r.gpus.count - 1} "
                f"(logical ids: {r.gpus.count} GPU(s) visible under CUDA_VISIBLE_DEVICES)"
            )
    if r.placement == "dedicated" and r.gpus.count < 2:
        raise PlanError("placement 'dedicated' needs at least 2 GPUs (one for the trainer, one for vLLM)")
