"""FSDP2 as its authors intend, for the sharded trainer: the model is built on the meta device (no process holds
the whole model), sharded layer by layer and then at the root (every group reshards after forward), materialized
shard by shard, and filled from rank 0, which reads the checkpoint one tensor at a time and scatters it (each
process receives only its shard). Mixed precision on CUDA (bf16 compute, fp32 gradient reduction), activation
checkpointing as a setting, gradients summed (not averaged) over processes.

`resident_weight_bytes` and `WeightProbe` measure what the frozen weights hold during a step (the memory proof)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .logprobs import token_logprobs
from .parallel import Parallel, broadcast_tensor, scatter_into
from .shared_prefix import decoder_hidden
from .weights import CheckpointReader

_DEFAULT = "default"  # PEFT's first adapter (the shared one)


class Scorer(nn.Module):
    """The trainer's one forward (the FSDP root): the decoder's hidden states at the asked positions, through the
    output head, so the head never computes logits for positions nobody trains; the head and its logsumexp run
    `chunk_tokens` positions at a time (None or 0: all at once; see `logprobs.token_logprobs`)."""

    def __init__(self, lm: nn.Module, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.share_prefix = (
            False  # rows' common prefix run once (`shared_prefix`): the one-process PEFT trainer
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        chosen: torch.Tensor,
        temperatures: torch.Tensor,
    ) -> torch.Tensor:
        """The logprob of `chosen[i]` after `positions[i]` of row `rows[i]`, its logits divided by
        `temperatures[i]` (fp32)."""
        hidden = decoder_hidden(self.lm.get_decoder(), input_ids, self.share_prefix)
        head = self.lm.get_output_embeddings()
        return token_logprobs(head, hidden[rows, positions], chosen, temperatures, self.chunk_tokens)


def shard(scorer: Scorer, parallel: Parallel, device_type: str) -> int:
    """`fully_shard` on each decoder layer, on the embeddings and on [final norm, head] (one group when the head is
    tied to the embeddings), then on the root; returns the number of groups. Gradients are summed over processes:
    each process's loss is already its share of the step's whole-step-normalised loss."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device_type == "cuda"
        else MixedPrecisionPolicy()
    )
    options: dict[str, Any] = {"mesh": parallel.mesh, "mp_policy": policy, "reshard_after_forward": True}
    lm = scorer.lm
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    groups = 0
    for layer in decoder.layers:
        fully_shard(layer, **options)
        groups += 1
    if not _tied(lm):
        fully_shard(decoder.embed_tokens, **options)
        tail = [m for m in (getattr(decoder, "norm", None), head) if m is not None]
        fully_shard(tail, **options)
        groups += 2
    fully_shard(scorer, **options)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return groups + 1


def build_sharded_peft(
    base_model: str,
    peft_config: Any,
    parallel: Parallel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    checkpointing: bool,
    adapters: Sequence[str] = (),
) -> tuple[Any, Scorer]:
    """The PEFT model, sharded and filled (see the module docstring), and its root `Scorer`. `adapters`: more
    PEFT adapters of the same config beside "default" (per-agent trainers), each starting from default's initial
    weights, sharded with their layers (all adapters' LoRA of a layer are one FSDP group with its base weights);
    "default" stays the active one."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(lm, peft_config)
    for name in adapters:
        model.add_adapter(name, peft_config)
    model.set_adapter(_DEFAULT)  # only its parameters require grad (PEFT's multi-adapter rule)
    initial = _lora_initial_values(model, seed) if parallel.leader else {}
    for name in adapters:  # every adapter starts where the shared one does
        marker = f".{_DEFAULT}."
        initial.update({k.replace(marker, f".{name}."): v for k, v in list(initial.items()) if marker in k})
    scorer = Scorer(lm)
    shard(scorer, parallel, device.type)
    scorer.to_empty(device=device)
    for module in lm.modules():  # rotary frequencies and other derived buffers: computed, not loaded
        if module._non_persistent_buffers_set:
            lm._init_weights(module)
    reader = CheckpointReader(base_model) if parallel.leader else None
    tied = _tied(lm)
    for name, param in model.named_parameters():  # the same order on every process
        value = _whole_value(name, reader, initial, tied) if reader is not None else None
        scatter_into(param, value, parallel)
    persistent = [
        (name, buffer)
        for module_name, module in model.named_modules()
        for name, buffer in module.named_buffers(prefix=module_name, recurse=False)
        if name.rpartition(".")[2] not in module._non_persistent_buffers_set
    ]
    for name, buffer in persistent:
        value = reader.read(checkpoint_key(name)) if reader is not None else None
        with torch.no_grad():
            buffer.copy_(
                broadcast_tensor(value, list(buffer.shape), buffer.dtype, parallel).to(buffer.device)
            )
    return model, scorer


def checkpoint_key(name: str) -> str:
    """The checkpoint's name for a PEFT model's base tensor (`base_model.model.x.base_layer.weight` -> `x.weight`;
    both copies of a `modules_to_save` module come from the original)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    name = name.replace(".original_module.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def _whole_value(
    name: str, reader: CheckpointReader, initial: dict[str, torch.Tensor], tied: bool
) -> torch.Tensor:
    if name in initial:
        return initial[name]
    key = checkpoint_key(name)
    if key not in reader and tied and key.endswith("lm_head.weight"):
        key = key.replace("lm_head.weight", "model.embed_tokens.weight")
    if key not in reader:
        raise ValueError(f"the checkpoint has no tensor {key!r} (for {name})")
    return reader.read(key)


def _lora_initial_values(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's initial LoRA weights, by PEFT's own initialisation (seeded), one layer at a time on the CPU."""
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    how = model.peft_config[adapter].init_lora_weights
    if how not in (True, "gaussian"):
        raise ValueError(f"the sharded trainer initialises LoRA as PEFT's default or 'gaussian', not {how!r}")
    values: dict[str, torch.Tensor] = {}
    torch.manual_seed(seed)
    for prefix, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        parts = {"lora_A": module.lora_A[adapter], "lora_B": module.lora_B[adapter]}
        for part in parts.values():
            part.to_empty(device="cpu")
        module.reset_lora_parameters(adapter, how)
        for kind, part in parts.items():
            for leaf, param in part.named_parameters():
                values[f"{prefix}.{kind}.{adapter}.{leaf}"] = param.detach().clone()
            part.to("meta")
    return values


def _tied(lm: Any) -> bool:
    head = lm.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None:  # PEFT's ModulesToSaveWrapper: the original module holds it
        weight = getattr(getattr(head, "original_module", None), "weight", None)
    return weight is lm.get_input_embeddings().weight


# --- the memory proof ---------------------------------------------------------------------------------------------


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the frozen weights hold right now: each process's shards, plus the whole copy of every group that is
    gathered at this moment (FSDP2's internals: this is a measurement, not part of training). Unsharded models:
    every frozen parameter."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    sharded = False
    seen: set[int] = set()  # a group of several modules ([norm, head]) is one state on each of them
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        sharded = True
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                if param.sharded_param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                total += param._sharded_param_data.untyped_storage().nbytes()
                total += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
    if sharded:
        return total
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in model.parameters()
        if not p.requires_grad
    }
    return sum(storages.values())


class WeightProbe:
    """Samples `resident_weight_bytes` as each decoder layer starts and ends its forward (with activation
    checkpointing, backward's recomputation too); `peak` is the most seen since `reset()`."""

    def __init__(self, scorer: Scorer, model: nn.Module) -> None:
        self.model = model
        self.peak = 0
        self._handles = []
        for layer in [*scorer.lm.get_decoder().layers, scorer]:
            self._handles.append(layer.register_forward_pre_hook(lambda *_: self.sample()))
            self._handles.append(layer.register_forward_hook(lambda *_: self.sample(), prepend=True))

    def sample(self) -> None:
        self.peak = max(self.peak, resident_weight_bytes(self.model))

    def reset(self) -> None:
        self.peak = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def frozen_weight_bytes(model: nn.Module) -> int:
    """The whole frozen weights' size (what one unsharded process holds)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
