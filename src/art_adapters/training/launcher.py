"""Starting and watching one host's trainer processes (no torchrun: the launcher sees each process, so one that
exits takes the others down at once). One host joins through a FileStore in a private folder and gloo/NCCL on
loopback, so nothing listens on the network; several hosts join rank 0's TCP store and prove a shared token
(`rendezvous.py`). `art-adapters trainer-worker` runs another host's share."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import LoRAConfig
from ..devices import child_visible_devices
from .rendezvous import TOKEN_ENV

WORKER_MODULE = "art_adapters.training.worker"


@dataclass(frozen=True)
class WorkerSpec:
    """What every process of one trainer is started with (the same on every host, but the store's address)."""

    base_model: str
    lora: LoRAConfig
    processes: int  # per host
    nodes: int = 1
    device: str = "cpu"
    engine: str = "peft"
    seed: int = 0
    max_seq_len: int = 2048
    logprob_chunk_tokens: int = 0  # 0: unchunked
    activation_checkpointing: bool = True
    collective_timeout_s: float = 60.0
    hsdp: bool = False
    adapters: tuple[str, ...] | None = None  # per-agent: the agents' adapters held from the start (None: one)

    def argv(self, store: str, module: str = WORKER_MODULE) -> list[str]:
        return [
            sys.executable,
            "-m",
            module,
            f"--store={store}",
            f"--nodes={self.nodes}",
            f"--processes={self.processes}",
            *self._model_flags(),
        ]

    def _model_flags(self) -> list[str]:
        """What every process of the run must be started with alike (a joining host's command included)."""
        return [
            f"--base-model={self.base_model}",
            f"--lora={self.lora.model_dump_json()}",
            f"--device={self.device}",
            f"--engine={self.engine}",
            f"--seed={self.seed}",
            f"--max-seq-len={self.max_seq_len}",
            f"--logprob-chunk-tokens={self.logprob_chunk_tokens}",
            f"--activation-checkpointing={int(self.activation_checkpointing)}",
            f"--collective-timeout={self.collective_timeout_s}",
            f"--hsdp={int(self.hsdp)}",
            *([] if self.adapters is None else [f"--adapters={json.dumps(list(self.adapters))}"]),
        ]

    def join_command(self, node_rank: int, master: str) -> str:
        """The shell command another host runs to join, quoted to survive copy and paste (the token travels in
        the environment, TOKEN_ENV, never on a command line)."""
        argv = [
            "art-adapters",
            "trainer-worker",
            f"--nodes={self.nodes}",
            f"--node-rank={node_rank}",
            f"--processes={self.processes}",
            f"--master={master}",
            *self._model_flags(),
        ]
        return shlex.join(argv)


class Ranks:
    """This host's processes of one trainer (node `node_rank`), each logging to `folder/rank{R}.log`."""

    def __init__(
        self,
        command: list[str],
        *,
        processes: int,
        node_rank: int,
        nodes: int,
        folder: Path,
        env: dict[str, str],
    ) -> None:
        self.folder = folder
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        world = processes * nodes
        threads = str(max(1, (os.cpu_count() or 1) // processes))
        try:
            for local in range(processes):
                rank = node_rank * processes + local
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(processes),
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", threads),
                }
                with (folder / f"rank{rank}.log").open("wb") as out:
                    self.processes[rank] = subprocess.Popen(
                        command, env=rank_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
        except BaseException:
            self.kill()
            raise

    def exited(self) -> tuple[int, int] | None:
        """The first (rank, exit code) of a process that has exited, or None while all run."""
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return rank, code
        return None

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.processes.values())

    def kill(self) -> None:
        """SIGKILL every process still running (a hung or stopped one too) and reap them."""
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass

    def wait_all(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.all_exited():
                return True
            time.sleep(0.05)
        return self.all_exited()

    def log_tail(self, first: int | None = None, lines: int = 25) -> str:
        """The end of each process's log (`first`'s first)."""
        order = sorted(self.processes, key=lambda r: (r != first, r))
        parts = []
        for rank in order:
            try:
                text = (self.folder / f"rank{rank}.log").read_text(errors="replace")
            except OSError:
                continue
            tail = "\n".join(line for line in text.splitlines() if line.strip())
            tail = "\n".join(tail.splitlines()[-lines:])
            if tail:
                parts.append(f"--- rank {rank} ---\n{tail}")
        return "\n".join(parts)


def host_env(single_host: bool, token: str, gpu_ids: list[int] | None) -> dict[str, str]:
    """The trainer processes' environment: the token (never argv), GPUs, and on one host loopback-only sockets.
    On the CPU, glibc returns every large freed block to the system at once and keeps one heap: otherwise its
    heaps keep FSDP2's freed all-gather buffers (measured: +250 MiB of RSS per process over one step of a 200 MB
    model, and ~70 MiB more or less from run to run with the heaps of gloo's threads)."""
    env = {**os.environ, TOKEN_ENV: token}
    if gpu_ids:  # this process's logical ids, as the ranks must see them
        env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(gpu_ids)
    else:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
        env.setdefault("MALLOC_ARENA_MAX", "1")
    if single_host:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


def adapters_flag(text: str) -> tuple[str, ...]:
    """`--adapters`: the JSON list of adapter names node 0 logs; anything else is a usage error naming it."""
    import argparse

    from ..agent_adapters import check_adapter_name

    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list):
        raise argparse.ArgumentTypeError(
            f'a JSON list of adapter names as node 0 logs it (\'["a", "b"]\'), not {text!r}'
        )
    try:
        return tuple(check_adapter_name(name) for name in names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def trainer_worker_command(argv: list[str] | None = None) -> int:
    """`art-adapters trainer-worker`: run this host's share of a sharded trainer (node 1..N-1) until it ends."""
    import argparse
    import tempfile

    from .rendezvous import join_token

    parser = argparse.ArgumentParser(
        prog="art-adapters trainer-worker",
        description="Run this host's share of a sharded trainer whose node 0 is an `art-adapters serve` (or a "
        f"LocalBackend) started with the same --trainer-nodes and --trainer-master. Node 0 logs the command for "
        f"each host. {TOKEN_ENV} must hold the same token as on node 0.",
    )
    parser.add_argument("--nodes", type=int, required=True, help="hosts in the trainer, this one included")
    parser.add_argument("--node-rank", type=int, required=True, help="this host's number, 1..nodes-1")
    parser.add_argument(
        "--processes", type=int, default=1, help="trainer processes on this host (one per GPU)"
    )
    parser.add_argument("--master", required=True, help="node 0's host:port")
    parser.add_argument("--base-model", required=True, help="the same base model (a path on this host)")
    parser.add_argument("--lora", default="{}", help="the model's LoRAConfig as JSON (node 0 logs it)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--engine", choices=["peft"], default="peft")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--logprob-chunk-tokens", type=int, default=0)
    parser.add_argument("--activation-checkpointing", type=int, choices=[0, 1], default=1)
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    parser.add_argument("--hsdp", type=int, choices=[0, 1], default=0)
    parser.add_argument("--gpu", type=int, action="append", default=None, help="a GPU to use (repeatable)")
    parser.add_argument(
        "--adapters",
        type=adapters_flag,
        default=None,
        help="per-agent adapters held from the start, as JSON (node 0 logs it)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.node_rank < args.nodes:
        raise SystemExit(f"--node-rank must be 1..{args.nodes - 1} (node 0 is the backend's host)")
    host, _, port = args.master.rpartition(":")
    if not host or not port.isascii() or not port.isdigit():
        raise SystemExit(f"--master must be host:port, not {args.master!r}")
    try:
        token = join_token(required=True)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    spec = WorkerSpec(
        base_model=args.base_model,
        lora=LoRAConfig.model_validate_json(args.lora),
        processes=args.processes,
        nodes=args.nodes,
        device=args.device,
        engine=args.engine,
        seed=args.seed,
        max_seq_len=args.max_seq_len,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
        activation_checkpointing=bool(args.activation_checkpointing),
        collective_timeout_s=args.collective_timeout,
        hsdp=bool(args.hsdp),
        adapters=args.adapters,
    )
    folder = Path(tempfile.mkdtemp(prefix="art-trainer-node-"))
    ranks = Ranks(
        spec.argv(f"tcp:{args.master}"),
        processes=args.processes,
        node_rank=args.node_rank,
        nodes=args.nodes,
        folder=folder,
        env=host_env(False, token, args.gpu if args.device == "cuda" else None),
    )
    print(f"trainer node {args.node_rank}: {args.processes} process(es), logs in {folder}", flush=True)
    try:
        while True:
            done = ranks.exited()
            if done is not None and (done[1] != 0 or ranks.all_exited()):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        done = (-1, 130)
    rank, code = done
    if code != 0 or not ranks.all_exited():
        ranks.kill()
        print(
            f"trainer node {args.node_rank}: rank {rank} exited with {code}\n{ranks.log_tail(rank)}",
            flush=True,
        )
    return 0 if code == 0 else 1
