"""Loading the one-process trainer's model: Unsloth's FastLanguageModel, or transformers + PEFT (the sharded
trainer builds its model in `fsdp.py`), and the LoRA settings as PEFT's config."""

from __future__ import annotations

from typing import Any

import torch

from ..config import LoRAConfig


def lora_settings(lora: LoRAConfig) -> dict[str, Any]:
    """Our LoRAConfig in the keywords PEFT's LoraConfig and Unsloth's get_peft_model share."""
    return {
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "modules_to_save": list(lora.modules_to_save) or None,
        "bias": "none",
    }


def peft_config(lora: LoRAConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(**lora_settings(lora), task_type="CAUSAL_LM")


def load_tokenizer(base_model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


def trainer_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """The trainer's weight dtype: bf16 on an Ampere or newer GPU, fp32 elsewhere (CPU, and pre-Ampere GPUs, whose
    bf16 is emulated and which Unsloth would silently switch to fp16). Half precision on a pre-Ampere GPU is
    refused: this trainer takes no loss-scaled fp16 steps, and unscaled fp16 gradients underflow."""
    if device.type != "cuda" or dtype == torch.float32:  # fp32 runs anywhere
        return dtype or torch.float32
    major, minor = torch.cuda.get_device_capability(device)
    ampere = major >= 8
    if dtype is None:
        return torch.bfloat16 if ampere else torch.float32
    if not ampere and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{device} ({name}, compute capability {major}.{minor}) cannot train in {dtype}: bf16 needs 8.0+ (Ampere) "
            "and this trainer takes no loss-scaled fp16 steps; use dtype=torch.float32 (the default there)"
        )
    return dtype


def load_peft(
    base_model: str, lora: LoRAConfig, dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool
) -> tuple[Any, Any]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    # Straight onto the trainer's device (no CPU copy first); on the CPU, transformers' plain load.
    placed = {"device_map": {"": device}} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype, **placed)
    if (
        gradient_checkpointing
    ):  # non-reentrant: LoRA weights get their gradients without inputs requiring grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, peft_config(lora)), load_tokenizer(base_model)


def load_unsloth(
    base_model: str,
    lora: LoRAConfig,
    dtype: torch.dtype,
    max_seq_len: int,
    gradient_checkpointing: bool,
    seed: int,
    device: torch.device | None = None,
    *,
    load_in_4bit: bool = False,
) -> tuple[Any, Any]:
    """Unsloth's model for rows of up to `max_seq_len` tokens (its `max_seq_length`: its decoder cuts longer
    inputs, so the trainer never hands it one), on the trainer's device, with Unsloth's own gradient
    checkpointing when asked."""
    from ..devices import noting_import_settings

    with noting_import_settings():  # its PYTORCH_ALLOC_CONF is this process's, not vLLM's
        from unsloth import FastLanguageModel

    # On the trainer's own GPU (Unsloth's default, "sequential", fills the first visible GPU: maybe vLLM's).
    placed = {"device_map": {"": device}} if device is not None and device.type == "cuda" else {}
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=base_model, max_seq_length=max_seq_len, dtype=dtype, load_in_4bit=load_in_4bit, **placed
    )
    model = FastLanguageModel.get_peft_model(
        model,
        **lora_settings(lora),
        use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
        random_state=seed,
    )
    return model, getattr(tokenizer, "tokenizer", tokenizer)
