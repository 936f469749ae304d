"""A sharded trainer's process group: joining it (a FileStore on one host, a TCP store across hosts; explicit
timeouts), the collectives the trainer runs outside FSDP2 (metric sums, agreement on an error, rank 0's bytes and
tensors on every process), and each process's share of a step's micro-batches.

Three groups: the training group (FSDP2's all-gathers and reduce-scatters, metric sums; `collective_timeout_s`, so
a hung or dead peer makes every other rank raise within that bound), a CPU control group (commands and start-up;
a long timeout, since ranks idle there between steps while the leader waits for the backend), and a CPU transfer
group (checkpoint bytes and tensors, memory reports: `collective_timeout_s` per collective, so a rank hung in a
save, a load or a memory report takes the group down within that bound, however large the checkpoint)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT_S = 30 * 60.0  # the leader pings the control group well within it (worker.IDLE_PING_S)


class AgreedError(Exception):
    """An error every rank raises alike (a refused batch, a checkpoint the leader cannot read or write): the group
    is still in step, so the trainer answers it and goes on. Any other exception in a rank aborts the group."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Parallel:
    """This process's place in the trainer's process group."""

    rank: int
    world: int
    local_rank: int
    nodes: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh: 1-D (FSDP) or ("replicate", "shard") (HSDP)
    control: Any  # the CPU (gloo) group for commands and start-up (CONTROL_TIMEOUT_S)
    transfer: Any = None  # the CPU (gloo) group for checkpoints and memory reports (collective_timeout_s)

    @property
    def bounded(self) -> Any:
        """The CPU group whose collectives time out after collective_timeout_s (the control group if none)."""
        return self.control if self.transfer is None else self.transfer

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def node(self) -> int:
        return self.rank // (self.world // self.nodes)


def join(
    store_spec: str,
    device_type: str,
    *,
    nodes: int = 1,
    hsdp: bool = False,
    collective_timeout_s: float = 60.0,
    start_timeout_s: float = 900.0,
) -> Parallel:
    """Join the group the launcher describes (RANK, WORLD_SIZE, LOCAL_RANK in the environment). `store_spec`:
    `file:PATH` (one host: nothing listens on the network) or `tcp:HOST:PORT` (several hosts; rank 0 serves it).
    NCCL for CUDA tensors, gloo for CPU tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind, _, where = store_spec.partition(":")
    if kind == "file":
        store: Any = dist.FileStore(where, world)
        store.set_timeout(timedelta(seconds=start_timeout_s))
    elif kind == "tcp":
        host, _, port = where.rpartition(":")
        store = dist.TCPStore(
            host,
            int(port),
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=start_timeout_s),
            wait_for_workers=False,
        )
    else:
        raise ValueError(f"store must be 'file:PATH' or 'tcp:HOST:PORT', not {store_spec!r}")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    transfer = dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout_s))
    if hsdp and nodes > 1:
        mesh = init_device_mesh(device_type, (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world,))
    return Parallel(
        rank=rank,
        world=world,
        local_rank=local_rank,
        nodes=nodes,
        mesh=mesh,
        control=control,
        transfer=transfer,
    )


# --- collectives outside FSDP2 ----------------------------------------------------------------------------------


def summed(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every process (training group)."""
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return dict(zip(keys, tensor.tolist(), strict=True))


def maxed(value: float) -> float:
    """The value's maximum over every process (training group)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def agree(parallel: Parallel, error: BaseException | None, group: Any = None) -> None:
    """Every rank calls this at the same point with its own outcome; if any rank failed, every rank raises the
    same AgreedError (the lowest failing rank's type and message). `group`: the training group (None) where the
    ranks arrive together, the control group where the leader arrives after reading or writing files."""
    failing = torch.tensor([parallel.rank if error is not None else parallel.world], dtype=torch.long)
    dist.all_reduce(failing, op=dist.ReduceOp.MIN, group=group)
    source = int(failing.item())
    if source == parallel.world:
        return
    if error is not None and parallel.rank == source:
        kind, message = (
            (error.kind, error.message)
            if isinstance(error, AgreedError)
            else (type(error).__name__, str(error))
        )
        payload: bytes | None = f"{kind}\n{message}".encode()
    else:
        payload = None
    reply = broadcast_bytes(payload, parallel, src=source, group=dist.group.WORLD if group is None else group)
    kind, _, message = reply.decode().partition("\n")
    raise AgreedError(kind, message)


def broadcast_bytes(payload: bytes | None, parallel: Parallel, *, src: int = 0, group: Any = None) -> bytes:
    """`src`'s bytes on every process (CPU tensors; the control group unless `group` is given)."""
    group = parallel.control if group is None else group
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    count = int(size.item())
    if not count:
        return b""
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if parallel.rank == src and payload
        else torch.empty(count, dtype=torch.uint8)
    )
    dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.numpy().tobytes())


def all_gather_bytes(
    payload: bytes, parallel: Parallel, limit: int | None = None, *, group: Any = None
) -> list[bytes]:
    """Every process's bytes, in rank order, on every process (the control group unless `group` is given).
    `limit`: refuse (on every process alike) a length over it before allocating for it: what the join exchanges
    before a peer is authenticated."""
    group = parallel.control if group is None else group
    size = torch.tensor([len(payload)], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(parallel.world)]
    dist.all_gather(sizes, size, group=group)
    for rank, declared in enumerate(int(s.item()) for s in sizes):
        if declared < 0 or (limit is not None and declared > limit):
            raise ConnectionError(f"rank {rank} declared {declared} bytes where at most {limit} are expected")
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    everyone = [torch.empty(width, dtype=torch.uint8) for _ in range(parallel.world)]
    dist.all_gather(everyone, mine, group=group)
    return [bytes(t[: int(s.item())].numpy().tobytes()) for t, s in zip(everyone, sizes, strict=True)]


def broadcast_tensor(
    value: torch.Tensor | None, shape: list[int], dtype: torch.dtype, parallel: Parallel, *, group: Any = None
) -> Any:
    """Rank 0's whole tensor on every process (CPU; the control group unless `group` is given)."""
    tensor = value.detach().to("cpu", dtype).contiguous() if parallel.leader and value is not None else None
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype)
    dist.broadcast(tensor, src=0, group=parallel.control if group is None else group)
    return tensor


def scatter_into(
    param: torch.Tensor, value: torch.Tensor | None, parallel: Parallel, *, group: Any = None
) -> None:
    """Fill a sharded parameter (or optimizer state) from rank 0's whole `value`: each process receives only its
    own shard (the others pass None). `group`: the CPU group for a parameter that is not sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if not isinstance(param, DTensor):
            whole = broadcast_tensor(value, list(param.shape), param.dtype, parallel, group=group)
            param.copy_(whole.to(param.device))
            return
        local = param.to_local()
        source = (
            value.detach().to(local.device, param.dtype)
            if parallel.leader and value is not None
            else torch.empty(param.shape, dtype=param.dtype, device=local.device)
        )
        part = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=0)
        local.copy_(part.to_local())


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every process when sharded: every process must call this)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


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
