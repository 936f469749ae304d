"""Save and resume a Trainer: the adapter in the PEFT format vLLM serves, plus optimizer and trainer state.

vLLM 0.32 rejects `modules_to_save` other than classifier heads, so a fully trained `lm_head` is written
as an exact LoRA delta instead: rank = hidden size, A = identity, B = W_trained - W_base, scaling 1.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config import LoRAConfig
from ..untrusted import parse_step
from .parallel import Parallel, full

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What saving and resuming read and set of a trainer (training/trainer.py's, in one process or sharded)."""

    model: Any
    optimizer: Any
    step: int
    base_model: str
    engine: str
    seed: int
    lora: LoRAConfig
    parallel: Parallel | None


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PREFIX = "base_model.model."


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves an adapter of this (largest) rank."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def adapter_tensors(model: Any, adapter: str = "default") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter's tensors and adapter_config, with every `modules_to_save` module turned into a LoRA delta
    (`adapter`: which of the model's PEFT adapters; per-agent trainers hold several)."""
    from peft import get_peft_model_state_dict

    config = model.peft_config[adapter].to_dict()
    state = {  # whole tensors, gathered from every process when sharded (in the same order on each)
        k: full(v.detach()).to("cpu", torch.float32).contiguous()
        for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()
    }
    targets = sorted(config["target_modules"])
    rank_pattern = dict(config.get("rank_pattern") or {})
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    base = model.get_base_model()
    for name in config.get("modules_to_save") or []:
        key = f"{_PREFIX}{name}.weight"
        if key not in state:
            raise ValueError(f"modules_to_save module {name!r} has no weight in the adapter")
        wrapper = base.get_submodule(name)
        original = full(wrapper.original_module.weight.detach()).to("cpu", torch.float32)
        trained = state.pop(key)
        if not isinstance(wrapper.original_module, torch.nn.Linear):
            raise ValueError(f"only Linear modules_to_save (lm_head) can be served by vLLM, not {name!r}")
        hidden = original.shape[1]
        state[f"{_PREFIX}{name}.lora_A.weight"] = torch.eye(hidden, dtype=torch.float32)
        state[f"{_PREFIX}{name}.lora_B.weight"] = (trained - original).contiguous()
        targets.append(name)
        rank_pattern[name] = hidden
        alpha_pattern[name] = hidden
    config.update(
        target_modules=sorted(set(targets)),
        modules_to_save=None,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        inference_mode=True,
        peft_type="LORA",
        task_type="CAUSAL_LM",
    )
    return state, config


def export_adapter(model: Any, directory: Path, adapter: str = "default") -> dict[str, Any]:
    """Write adapter_config.json + adapter_model.safetensors (loads in PEFT and in vLLM); returns the config."""
    state, config = adapter_tensors(model, adapter)
    write_adapter(state, config, directory)
    return config


def write_adapter(state: dict[str, torch.Tensor], config: dict[str, Any], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")


def required_max_lora_rank(config: dict[str, Any]) -> int:
    ranks = [int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    return vllm_max_lora_rank(max(ranks))


def save_trainer(trainer: Trainer, directory: Path, adapter: str = "default") -> Path:
    """Adapter + `optimizer.pt` (optimizer, exact trainable tensors, rng) + `trainer_state.json`: the same files
    of one process (a sharded trainer's are written by shard_io, in the same files). `adapter`: the PEFT adapter
    written, which must be the active (trainable) one, with `trainer.optimizer` its optimizer."""
    config = export_adapter(trainer.model, directory, adapter)
    params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    write_trainer_files(trainer, directory, config, params, trainer.optimizer.state_dict())
    return directory


def write_trainer_files(
    trainer: Trainer,
    directory: Path,
    config: dict[str, Any],
    params: dict[str, Any],
    optimizer: dict[str, Any],
) -> None:
    state: dict[str, Any] = {
        "optimizer": optimizer,
        "params": params,
        "rng": torch.get_rng_state(),
        "step": trainer.step,
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, directory / OPTIMIZER_STATE)
    info = {
        "step": trainer.step,
        "base_model": trainer.base_model,
        "engine": trainer.engine,
        "seed": trainer.seed,
        "lora": trainer.lora.model_dump(),
        "vllm_max_lora_rank": required_max_lora_rank(config),
    }
    (directory / TRAINER_STATE).write_text(json.dumps(info, indent=2) + "\n")


def load_trainer(trainer: Trainer, directory: Path) -> None:
    """Resume exactly from `save_trainer`; from a bare adapter dir, load its weights only (fresh optimizer). A
    checkpoint folder's name is its step (a step that trained nothing took over the previous step's folder)."""
    named_step = parse_step(directory.name)
    if not (directory / OPTIMIZER_STATE).exists():
        load_adapter_weights(trainer.model, directory)
        info = directory / TRAINER_STATE
        trainer.step = json.loads(info.read_text())["step"] if info.exists() else trainer.step
        trainer.step = named_step if named_step is not None else trainer.step
        return
    state = torch.load(directory / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
    named = dict(trainer.model.named_parameters())
    check_params(state["params"], named, directory)
    with torch.no_grad():
        for name, tensor in state["params"].items():
            named[name].copy_(tensor.to(named[name].device, named[name].dtype))
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step = named_step if named_step is not None else int(state["step"])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        restore_cuda_rng(state["cuda_rng"], directory)


_warned_rng: set[tuple[int, int]] = set()


def restore_cuda_rng(states: list[torch.Tensor], directory: Path) -> None:
    """Each visible GPU's generator from the checkpoint's, as far as both go: a checkpoint of an 8-GPU run
    resumes on one GPU (the states of GPUs not seen here are left unused, with one warning)."""
    count = torch.cuda.device_count()
    for index in range(min(len(states), count)):
        torch.cuda.set_rng_state(states[index], device=index)
    if len(states) != count and (len(states), count) not in _warned_rng:
        _warned_rng.add((len(states), count))
        log.warning(
            "checkpoint %s holds the CUDA rng states of %d GPU(s) and %d are visible: restored %d",
            directory,
            len(states),
            count,
            min(len(states), count),
        )


def check_params(saved: dict[str, Any], named: dict[str, torch.Tensor], directory: Path) -> None:
    missing = sorted(set(saved) ^ {n for n, p in named.items() if p.requires_grad})
    if missing:
        raise ValueError(f"checkpoint {directory} does not match this adapter's parameters: {missing[:4]}")


def load_adapter_weights(model: Any, directory: Path) -> None:
    """Load an exported adapter into a PEFT model of the same LoRAConfig (LoRA deltas back into full modules)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, adapter_state(model, directory))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter {directory} has tensors this model lacks: {unexpected[:4]}")


def adapter_state(model: Any, directory: Path) -> dict[str, torch.Tensor]:
    """An exported adapter's tensors in PEFT's state-dict names (a `modules_to_save` delta turned back into the
    trained module: the original plus B @ A)."""
    from safetensors.torch import load_file

    state = load_file(str(directory / ADAPTER_WEIGHTS))
    config = model.peft_config[model.active_adapter]
    base = model.get_base_model()
    for name in config.modules_to_save or []:
        a, b = state.pop(f"{_PREFIX}{name}.lora_A.weight"), state.pop(f"{_PREFIX}{name}.lora_B.weight")
        original = full(base.get_submodule(name).original_module.weight.detach()).float().cpu()
        state[f"{_PREFIX}{name}.weight"] = original + b @ a
    return state


def vllm_unservable_modules(base_model: str | Path, modules_to_save: list[str]) -> list[str] | None:
    """The `modules_to_save` vLLM cannot serve for this base model's architecture (None: vLLM not importable).

    vLLM serves a full `lm_head` only as the LoRA delta above, and only for architectures whose vLLM class lists
    `lm_head` in `embedding_modules` (0.32: Llama, Qwen3, ... but not Qwen2). Imports vLLM: call it once, e.g.
    when the backend registers a model, not per step.
    """
    if not modules_to_save:
        return []
    architecture = json.loads((Path(base_model) / "config.json").read_text())["architectures"][0]
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        model_cls = ModelRegistry._try_load_model_cls(architecture)
    except Exception:  # vLLM absent or its registry changed
        return None
    supported = set(getattr(model_cls, "embedding_modules", None) or {})
    return [m for m in modules_to_save if m != "lm_head" or m not in supported]
