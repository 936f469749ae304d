"""A sharded trainer's checkpoint, in the one-process files: every process takes part in gathering the adapter and
optimizer state, the leader alone writes; on resume the leader alone reads (another host needs no shared
filesystem) and scatters each tensor, every process receiving only its shard. A file the leader cannot read or
write is an error every process raises alike (`parallel.agree`), so the group stays in step. Every collective here
runs on the transfer group: a rank hung in a save or load takes the group down within collective_timeout_s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .adapter_io import (
    _PREFIX,
    ADAPTER_WEIGHTS,
    OPTIMIZER_STATE,
    TRAINER_STATE,
    Trainer,
    adapter_tensors,
    check_params,
    write_adapter,
    write_trainer_files,
)
from .parallel import Parallel, agree, broadcast_bytes, broadcast_tensor, full, is_sharded, scatter_into


def save_sharded(trainer: Trainer, directory: Path, adapter: str = "default") -> Path:
    """`adapter`: the PEFT adapter written, which must be the active (trainable) one, with `trainer.optimizer`
    its optimizer (as `adapter_io.save_trainer`)."""
    parallel = _parallel(trainer)
    state, config = adapter_tensors(trainer.model, adapter)
    params = {n: full(p.detach()).cpu() for n, p in trainer.model.named_parameters() if p.requires_grad}
    optimizer = _whole(trainer.optimizer.state_dict())
    error: Exception | None = None
    if parallel.leader:
        try:
            write_adapter(state, config, directory)
            write_trainer_files(trainer, directory, config, params, optimizer)
        except Exception as failure:  # a full disk, a folder gone: every process reports it, none aborts
            error = failure
    agree(parallel, error, group=parallel.bounded)
    return directory


def load_sharded(trainer: Trainer, directory: Path) -> None:
    parallel = _parallel(trainer)
    named = dict(trainer.model.named_parameters())  # the same order on every process
    trainable = [n for n, p in named.items() if p.requires_grad]
    saved: dict[str, Any] = {}
    described: bytes | None = None
    error: Exception | None = None
    if parallel.leader:
        try:  # everything checked here, before the ranks agree: past it, a failure would abort the group
            saved = _read(trainer, directory, named)
            described = json.dumps(_manifest(trainer, saved, directory)).encode()
        except Exception as failure:
            error = failure
    agree(parallel, error, group=parallel.bounded)
    manifest = json.loads(broadcast_bytes(described, parallel, group=parallel.bounded))
    for name in trainable:
        scatter_into(
            named[name], saved["params"][name] if parallel.leader else None, parallel, group=parallel.bounded
        )
    if manifest["optimizer"] is not None:
        trainer.optimizer.load_state_dict(_optimizer_state(trainer, manifest["optimizer"], saved, parallel))
    if manifest["rng"] is not None:
        rng = broadcast_tensor(
            saved.get("rng"), manifest["rng"], torch.uint8, parallel, group=parallel.bounded
        )
        torch.set_rng_state(rng)
    trainer.step = int(manifest["step"])


def _read(trainer: Trainer, directory: Path, named: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The leader's whole checkpoint: from `save` (optimizer included), or a bare adapter folder (weights only)."""
    if (directory / OPTIMIZER_STATE).exists():
        saved = torch.load(directory / OPTIMIZER_STATE, map_location="cpu", weights_only=True, mmap=True)
        check_params(saved["params"], named, directory)
        return saved
    if not (directory / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(f"{directory} holds no adapter ({ADAPTER_WEIGHTS})")
    info = directory / TRAINER_STATE
    step = json.loads(info.read_text())["step"] if info.exists() else trainer.step
    return {"params": _adapter_params(trainer, directory, named), "step": step}


def _adapter_params(
    trainer: Trainer, directory: Path, named: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """An exported adapter's tensors under the model's parameter names (a `modules_to_save` delta turned back into
    the trained module, its original read from the base checkpoint)."""
    from safetensors.torch import load_file

    from .fsdp import checkpoint_key
    from .weights import CheckpointReader

    state = load_file(str(directory / ADAPTER_WEIGHTS))
    model = trainer.model
    adapter = model.active_adapter
    base = CheckpointReader(trainer.base_model)
    params: dict[str, torch.Tensor] = {}
    for name in model.peft_config[adapter].modules_to_save or []:
        a, b = state.pop(f"{_PREFIX}{name}.lora_A.weight"), state.pop(f"{_PREFIX}{name}.lora_B.weight")
        original = base.read(checkpoint_key(f"{_PREFIX}{name}.weight")).float()
        params[f"{_PREFIX}{name}.modules_to_save.{adapter}.weight"] = original + b @ a
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        params[f"{head}.{adapter}.{leaf}"] = value
    unknown = sorted(set(params) - set(named))
    if unknown:
        raise ValueError(f"adapter {directory} has tensors this model lacks: {unknown[:4]}")
    check_params(params, named, directory)
    return params


def _manifest(trainer: Trainer, saved: dict[str, Any], directory: Path) -> dict[str, Any]:
    """What the other processes need to receive the leader's tensors: shapes, dtypes and the plain values. Raises
    (on the leader, before the ranks agree) for a checkpoint this trainer cannot take: a step that is not a
    whole number, optimizer state this model's parameters do not fit, an RNG state of another size."""
    step = saved.get("step")
    if isinstance(step, bool) or not isinstance(step, int | float) or step != int(step) or step < 0:
        raise ValueError(f"checkpoint {directory} has step {step!r}, not a whole number")
    optimizer = saved.get("optimizer")
    entries = None
    if optimizer is not None:
        _check_optimizer(trainer, optimizer, directory)
        entries = {
            "param_groups": optimizer["param_groups"],
            "state": {
                str(index): {
                    key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
                    if isinstance(value, torch.Tensor)
                    else {"value": value}
                    for key, value in values.items()
                }
                for index, values in optimizer["state"].items()
            },
        }
    rng = saved.get("rng")
    if rng is not None:
        expected = torch.get_rng_state()
        if not isinstance(rng, torch.Tensor) or rng.dtype != expected.dtype or rng.shape != expected.shape:
            raise ValueError(f"checkpoint {directory} has an RNG state this process cannot take")
    return {"step": int(step), "optimizer": entries, "rng": list(rng.shape) if rng is not None else None}


def _check_optimizer(trainer: Trainer, optimizer: Any, directory: Path) -> None:
    """The saved optimizer state fits this model: its groups, parameter indices and per-parameter tensor shapes."""
    bad = ValueError(f"checkpoint {directory} has optimizer state this model's parameters do not fit")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        raise bad
    groups, ours = optimizer.get("param_groups"), trainer.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(ours):
        raise bad
    for group, our in zip(groups, ours, strict=True):
        if not isinstance(group, dict) or len(group.get("params", ())) != len(our["params"]):
            raise bad
    for index, values in optimizer["state"].items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(trainer.params):
            raise bad
        if not isinstance(values, dict):
            raise bad
        shape = tuple(trainer.params[index].shape)
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and tuple(value.shape) != shape:
                raise bad


def _optimizer_state(
    trainer: Trainer, manifest: dict[str, Any], saved: dict[str, Any], parallel: Parallel
) -> dict[str, Any]:
    """The saved optimizer state with each per-parameter tensor sharded as its parameter is."""
    state: dict[int, dict[str, Any]] = {}
    whole = saved["optimizer"]["state"] if parallel.leader else {}
    for index_text in sorted(manifest["state"], key=int):
        index = int(index_text)
        param = trainer.params[index]
        state[index] = {}
        for key, entry in manifest["state"][index_text].items():
            if "value" in entry:
                state[index][key] = entry["value"]
                continue
            value = whole[index][key] if parallel.leader else None
            dtype = getattr(torch, entry["dtype"])
            if is_sharded(param) and entry["shape"] == list(param.shape):
                target = torch.empty_like(param, dtype=dtype)
                scatter_into(target, value, parallel, group=parallel.bounded)
                state[index][key] = target
            else:
                state[index][key] = broadcast_tensor(
                    value, entry["shape"], dtype, parallel, group=parallel.bounded
                )
    return {"state": state, "param_groups": manifest["param_groups"]}


def _whole(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every sharded tensor gathered whole (the one-process format)."""
    state = {
        index: {
            key: full(value).cpu() if isinstance(value, torch.Tensor) else value for key, value in s.items()
        }
        for index, s in optimizer_state["state"].items()
    }
    return {"state": state, "param_groups": optimizer_state["param_groups"]}


def _parallel(trainer: Trainer) -> Parallel:
    assert trainer.parallel is not None
    return trainer.parallel
