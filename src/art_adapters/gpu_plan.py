"""One memory plan for a base model on the GPUs at hand: placement, vLLM's share, TP × replicas, the trainer's
dtype, checkpointing, logprob chunks and micro-batch tokens, decided from config.json before anything loads.

Pure arithmetic over the model's config and the GPUs' sizes (torch only to detect GPUs, imported lazily), so a user
can plan on a laptop from a folder holding only config.json. `LocalBackend` and `art-adapters serve` start from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Placement = Literal["cpu", "shared", "dedicated"]
TrainerDType = Literal["bfloat16", "float16", "float32"]


class PlanError(ValueError):
    """A configuration that cannot fit (the numbers say why), or input the plan cannot read. `nearest` is the
    closest plan that fits, when there is one."""

    def __init__(self, message: str, nearest: Plan | None = None) -> None:
        super().__init__(message)
        self.nearest = nearest


@dataclass(frozen=True)
class GPUs:
    """The GPUs a plan may use: how many (logical ids 0..count-1 under CUDA_VISIBLE_DEVICES), each one's total
    memory as torch reports it, and compute capability (bf16 needs 8.0+)."""

    count: int
    memory_gib: float
    capability: tuple[int, int] = (9, 0)
    name: str = ""

    @classmethod
    def detect(cls) -> GPUs | None:
        """The visible CUDA GPUs (the smallest one's memory and capability), or None without CUDA."""
        raise NotImplementedError  # filled in by the plan's implementation


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read from a Hugging Face config.json."""

    model_type: str
    parameters: int
    layers: int
    hidden_size: int
    intermediate_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """From a model folder (or a config.json itself); PlanError naming the file and field on bad input."""
        raise NotImplementedError  # filled in by the plan's implementation


class Plan(BaseModel):
    """Every decision, and the estimates (GiB) behind them. Each field can be overridden at `make_plan`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The base model's folder (or name) the plan is for.")
    placement: Placement
    gpu_count: int = 0
    gpu_memory_gib: float = 0.0
    trainer_gpu_ids: list[int] = Field(default_factory=list, description="Logical ids (CUDA_VISIBLE_DEVICES).")
    inference_gpu_ids: list[int] = Field(default_factory=list, description="Logical ids.")
    tensor_parallel_size: int = 1
    replicas: int = 1
    gpu_memory_utilization: float = Field(0.0, description="vLLM's share of each inference GPU (0 on CPU).")
    enable_sleep_mode: bool = False
    kv_cache_tokens: int = 0
    max_seq_len: int
    trainer_dtype: TrainerDType = "bfloat16"
    load_in_4bit: bool = False
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024
    micro_batch_tokens: int = 4096
    offload_trainer: bool = Field(False, description="Trainer weights to CPU between steps (shared GPU).")
    estimates_gib: dict[str, float] = Field(default_factory=dict)


def make_plan(
    model: str | Path | ModelShape,
    gpus: GPUs | None,
    *,
    max_seq_len: int | None = None,
    lora_rank: int = 16,
    tokens_per_step: int | None = None,
    micro_batch_tokens: int | None = None,
    placement: Placement | None = None,
    trainer_gpu_ids: list[int] | None = None,
    inference_gpu_ids: list[int] | None = None,
    tensor_parallel_size: int | None = None,
    replicas: int | None = None,
    gpu_memory_utilization: float | None = None,
    load_in_4bit: bool | None = None,
    gradient_checkpointing: bool | None = None,
    logprob_chunk_tokens: int | None = None,
) -> Plan:
    """The plan for `model` on `gpus` (None: the CPU). Any keyword given overrides that decision; a plan that
    cannot fit raises PlanError with the numbers and the nearest plan that fits."""
    raise NotImplementedError  # filled in by the plan's implementation
