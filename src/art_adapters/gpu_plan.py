"""One memory plan for a base model on the GPUs at hand: placement, vLLM's share, TP × replicas, the trainer's
dtype, checkpointing, logprob chunks and micro-batch tokens, decided from config.json before anything loads.

Pure arithmetic over the model's config and the GPUs' sizes (torch only to detect GPUs, imported lazily), so a user
can plan on a laptop from a folder holding only config.json. `LocalBackend` and `art-adapters serve` start from it.
The formulas are in gpu_memory.py, the checks in gpu_plan_request.py, the search in gpu_plan_search.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
        """The visible CUDA GPUs (the smallest one's memory and capability), or None without CUDA.

        torch numbers the devices it sees 0..count-1 whatever CUDA_VISIBLE_DEVICES names, so the plan's ids are
        logical ids. Reading the properties initializes CUDA in this process (no memory is allocated)."""
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            return None
        count = int(torch.cuda.device_count())
        if count < 1:
            return None
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        smallest = min(props, key=lambda p: int(p.total_memory))
        capability = min((int(p.major), int(p.minor)) for p in props)
        return cls(count, int(smallest.total_memory) / 2**30, capability, str(smallest.name))


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
        source = Path(path).expanduser()
        file = source / "config.json" if source.is_dir() else source
        if not file.is_file():
            raise PlanError(
                f"{file}: no such file (give a model folder holding config.json, or the file itself)"
            )
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise PlanError(f"{file}: not readable as JSON ({error})") from error
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, data: Any, source: str = "config.json") -> ModelShape:
        """From config.json's content (a multimodal config's `text_config` is the language model's)."""
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected a JSON object, got {type(data).__name__}")
        config = dict(data)
        if isinstance(data.get("text_config"), dict):
            config = {**data, **data["text_config"]}
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            experts = config.get(key)
            if isinstance(experts, (int, float)) and not isinstance(experts, bool) and experts > 1:
                raise PlanError(
                    f"{source}: field {key!r} = {config[key]}: mixture-of-experts models are not planned"
                )

        def number(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if value is None:
                raise PlanError(f"{source}: field {key!r} is missing")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
            return value

        def flag(key: str) -> bool:
            value = config.get(key, False)
            if not isinstance(value, bool):
                raise PlanError(f"{source}: field {key!r} must be true or false, got {value!r}")
            return value

        model_type = str(config.get("model_type") or "")
        layers, hidden = number("num_hidden_layers"), number("hidden_size")
        intermediate, heads = number("intermediate_size"), number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        if heads % kv_heads:
            raise PlanError(
                f"{source}: field 'num_key_value_heads' = {kv_heads} does not divide num_attention_heads = {heads}"
            )
        if config.get("head_dim") is None and hidden % heads:
            raise PlanError(
                f"{source}: field 'head_dim' is missing and hidden_size {hidden} is not a multiple of {heads}"
            )
        head_dim = number("head_dim", hidden // heads)
        vocab, context = number("vocab_size"), number("max_position_embeddings")
        tied = flag("tie_word_embeddings")
        # Qwen2 biases q, k and v (no config key); Llama/Mistral-style `attention_bias` biases q, k, v and o.
        qkv_bias = model_type.startswith("qwen2") or flag("attention_bias")
        o_bias = flag("attention_bias")
        qk_norm = model_type.startswith("qwen3")  # Qwen3 RMS-normalizes q and k per head
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        attention = 2 * hidden * q_out + 2 * hidden * kv_out
        attention += (q_out + 2 * kv_out) * qkv_bias + hidden * o_bias + 2 * head_dim * qk_norm
        mlp = 3 * hidden * intermediate + (2 * intermediate + hidden) * flag("mlp_bias")
        per_layer = attention + mlp + 2 * hidden  # + the two RMSNorms
        parameters = vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
        return cls(
            model_type,
            parameters,
            layers,
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context,
            tied,
        )


class Plan(BaseModel):
    """Every decision, and the estimates (GiB) behind them. Each field can be overridden at `make_plan`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The base model's folder (or name) the plan is for.")
    placement: Placement
    gpu_count: int = 0
    gpu_memory_gib: float = 0.0
    trainer_gpu_ids: list[int] = Field(
        default_factory=list, description="Logical ids (CUDA_VISIBLE_DEVICES)."
    )
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
    loss_scaling: bool = Field(
        False, description="float16 trainer (no bf16 below capability 8.0): scale the loss."
    )
    gpu_name: str = ""
    notes: list[str] = Field(default_factory=list, description="Why each decision was taken.")


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
    from .gpu_plan_request import Request
    from .gpu_plan_search import plan_request

    if isinstance(model, ModelShape):
        shape, name = model, model.model_type or "model"
    else:
        shape, name = load_shape(model), str(model)
    request = Request(
        name=name,
        shape=shape,
        gpus=gpus,
        max_seq_len=max_seq_len,
        lora_rank=lora_rank,
        tokens_per_step=tokens_per_step,
        micro_batch_tokens=micro_batch_tokens,
        placement=placement,
        trainer_gpu_ids=trainer_gpu_ids,
        inference_gpu_ids=inference_gpu_ids,
        tensor_parallel_size=tensor_parallel_size,
        replicas=replicas,
        gpu_memory_utilization=gpu_memory_utilization,
        load_in_4bit=load_in_4bit,
        gradient_checkpointing=gradient_checkpointing,
        logprob_chunk_tokens=logprob_chunk_tokens,
    )
    return plan_request(request)


def load_shape(model: str | Path) -> ModelShape:
    """A local folder or config.json; else a hub name, whose config.json alone is fetched (or found in the cache)."""
    path = Path(model).expanduser()
    if (
        path.exists()
        or isinstance(model, Path)
        or str(model).startswith((".", "/", "~"))
        or str(model).count("/") != 1
    ):
        return ModelShape.from_config(path)
    try:
        from huggingface_hub import hf_hub_download

        return ModelShape.from_config(hf_hub_download(str(model), "config.json"))
    except PlanError:
        raise
    except Exception as error:  # noqa: BLE001 - any hub failure is the same answer to the user
        raise PlanError(
            f"{model}: no such folder, and its config.json could not be fetched from the hub "
            f"({type(error).__name__}: {error}); give a folder holding config.json"
        ) from error


_LABELS = {
    "trainer_weights": "trainer base weights",
    "lora_optimizer": "LoRA + grads + AdamW (fp32)",
    "activations": "activations (one micro-batch)",
    "logits": "logits (one chunk)",
    "trainer_overhead": "trainer CUDA context + workspace",
    "vllm_asleep": "vLLM asleep (level 1)",
    "training_total": "= training phase",
    "vllm_weights": "vLLM weights (per GPU)",
    "vllm_overhead": "vLLM context, graphs, activations",
    "kv_cache": "vLLM KV cache (per GPU)",
    "inference_total": "= vLLM's share (utilization × memory)",
    "trainer_offloaded": "trainer offloaded (context left)",
    "inference_phase_total": "= inference phase",
    "host_weights": "trainer weights in host memory (fp32)",
    "usable": "usable: memory less max(0.5 GiB, 5%)",
}


def format_plan(plan: Plan) -> str:
    """The plan as a table: each decision, then the estimates beside the GPU's memory."""
    where = (
        "the CPU"
        if plan.placement == "cpu"
        else f"{plan.gpu_count} × {plan.gpu_name or 'GPU'} ({plan.gpu_memory_gib:.1f} GiB each)"
    )
    rows: list[tuple[str, str]] = [("placement", plan.placement)]
    if plan.placement != "cpu":
        rows += [
            ("trainer GPUs", _ids(plan.trainer_gpu_ids)),
            ("inference GPUs", _ids(plan.inference_gpu_ids)),
            ("tensor parallel × replicas", f"{plan.tensor_parallel_size} × {plan.replicas}"),
            ("vLLM gpu_memory_utilization", f"{plan.gpu_memory_utilization:g}"),
            ("vLLM sleep mode", _yes(plan.enable_sleep_mode)),
            ("KV cache tokens (per replica)", f"{plan.kv_cache_tokens:,}"),
            ("offload trainer between steps", _yes(plan.offload_trainer)),
        ]
    dtype = plan.trainer_dtype + (" + loss scaling" if plan.loss_scaling else "")
    rows += [
        ("max_seq_len", f"{plan.max_seq_len:,}"),
        ("trainer dtype", dtype + (" (4-bit base)" if plan.load_in_4bit else "")),
        ("gradient checkpointing", _yes(plan.gradient_checkpointing)),
        ("logprob chunk tokens", f"{plan.logprob_chunk_tokens:,}"),
        ("micro-batch tokens", f"{plan.micro_batch_tokens:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"Plan for {plan.model} on {where}", ""] + [f"  {k:<{width}}  {v}" for k, v in rows]
    if plan.estimates_gib:
        memory = f"{plan.gpu_memory_gib:.1f}" if plan.placement != "cpu" else "host"
        lines += ["", f"  {'estimate':<40} {'GiB':>7}   of {memory}"]
        for key, value in plan.estimates_gib.items():
            if key in _LABELS:
                lines.append(f"  {_LABELS[key]:<40} {value:>7.2f}")
    lines += [""] + [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def _ids(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _yes(value: bool) -> str:
    return "yes" if value else "no"
