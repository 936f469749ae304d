"""Data-parallel, sharded training under torch.distributed: the frozen base's decoder layers sharded with FSDP2
(`fully_shard`), each process training its share of a step's micro-batches, gradients summed by the engine.

The step's loss is normalised by the whole step's totals, so the step's gradient is the *sum* of the processes'
gradients: each process scales its loss by the world size, which FSDP2's mean reduction divides out (gloo has no
pre-multiplied sum to set FSDP2's divide factor to 1). FSDP2 gathers a layer's shards at every forward, so every process
runs the same number of micro-batches: one with fewer pads with empty ones. Parameters outside the sharded layers
(embeddings, a trained `lm_head`) stay whole on every process; their gradients are all-reduced here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    """This process's place in the trainer's process group."""

    rank: int
    world: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh

    @property
    def leader(self) -> bool:
        return self.rank == 0


def init_from_env(device_type: str) -> Parallel:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...): NCCL on CUDA, gloo on CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        # CPU tensors (metric sums, norms, commands) go through gloo, CUDA tensors through NCCL
        dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = dist.get_world_size()
    return Parallel(rank=dist.get_rank(), world=world, mesh=init_device_mesh(device_type, (world,)))


def shard_decoder_layers(model: Any, parallel: Parallel) -> int:
    """FSDP2 over each decoder layer of a PEFT-wrapped causal LM (LoRA weights shard with their layer);
    returns how many layers were sharded."""
    from torch.distributed.fsdp import fully_shard

    layers = model.get_base_model().model.layers
    for layer in layers:
        fully_shard(layer, mesh=parallel.mesh)
    return len(layers)


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every process when sharded: every process must call this)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def copy_full_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a (possibly sharded) parameter from its whole value."""
    with torch.no_grad():
        if is_sharded(param):
            from torch.distributed.tensor import distribute_tensor

            part = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)  # type: ignore[attr-defined]
            param.to_local().copy_(part.to_local())  # type: ignore[attr-defined]
        else:
            param.copy_(value.to(param.device, param.dtype))


def sum_whole_gradients(params: list[torch.Tensor], world: int) -> None:
    """The gradients of the parameters FSDP2 does not manage, summed over processes (their losses were scaled by
    the world size, as FSDP2's averaging needs: that scale is divided out here)."""
    for param in params:
        if param.grad is not None and not is_sharded(param):
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(world)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the step's gradient to `max_norm` (the norm over every process's shards, each element counted once)."""
    sharded_sq = torch.zeros((), dtype=torch.float64)
    whole_sq = torch.zeros((), dtype=torch.float64)
    for param in params:
        if param.grad is None:
            continue
        if is_sharded(param):
            sharded_sq += param.grad.to_local().double().pow(2).sum().cpu()  # type: ignore[attr-defined]
        else:
            whole_sq += param.grad.double().pow(2).sum().cpu()
    dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM)
    norm = (sharded_sq + whole_sq).sqrt()
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
    return norm.float()


def my_share(batches: list[list[int]], sizes: list[int], parallel: Parallel) -> tuple[list[list[int]], int]:
    """This process's micro-batches (balanced by tokens, greedy: the largest batch to the least loaded process)
    and how many every process runs (the most any process has)."""
    loads = [0] * parallel.world
    owned: list[list[list[int]]] = [[] for _ in range(parallel.world)]
    order = sorted(range(len(batches)), key=lambda i: -sum(sizes[j] for j in batches[i]))
    for i in order:
        target = min(range(parallel.world), key=lambda r: (loads[r], r))
        owned[target].append(batches[i])
        loads[target] += sum(sizes[j] for j in batches[i])
    mine = sorted(owned[parallel.rank], key=lambda b: b[0])
    return mine, max(len(o) for o in owned)


def broadcast_bytes(payload: bytes | None, parallel: Parallel, group: Any) -> bytes:
    """Rank 0's bytes on every process (over the CPU `group`)."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if parallel.leader and payload
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    if int(size.item()):
        dist.broadcast(buffer, src=0, group=group)
    return bytes(buffer.numpy().tobytes())
