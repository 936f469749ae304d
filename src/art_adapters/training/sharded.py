"""A Trainer that is N processes under torchrun (FSDP2, `parallel.py`), driven from the backend's process: the same
methods as `Trainer` (train_step, sft_step, save, load, logprobs_of, step), each sent to the workers' leader over
a Unix socket in a private folder. One setting chooses it: `LocalBackend(trainer_processes=N)`."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from .tokenize import TokenizationError
from .worker import receive, send

log = logging.getLogger(__name__)
Metrics = dict[str, Any]


class TrainerProcessError(RuntimeError):
    """The sharded trainer's processes failed (the message holds the end of their log)."""


class ShardedTrainer:
    """`processes` trainer processes on this host (`gpu_ids`: one GPU each; none: CPU, gloo). With `nodes > 1`,
    this host is node 0 of torchrun's static rendezvous at `master` ("host:port", reachable from the others),
    and each other host joins with `worker_command(...)` (`art-adapters trainer-worker`)."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        processes: int,
        gpu_ids: list[int] | None = None,
        nodes: int = 1,
        master: str | None = None,
        engine: str = "auto",
        seed: int = 0,
        max_seq_len: int = 2048,
        start_timeout_s: float = 900.0,
    ) -> None:
        if processes < 1:
            raise ValueError(f"trainer processes must be >= 1, not {processes}")
        if gpu_ids and len(gpu_ids) != processes:
            raise ValueError(f"{processes} trainer processes need {processes} GPU ids, not {gpu_ids}")
        if nodes > 1 and not master:
            raise ValueError(
                "a trainer on several hosts needs master='host:port' (this host, reachable by the others)"
            )
        self.base_model = str(base_model)
        self.lora = lora or LoRAConfig()
        self.processes = processes
        self._lock = threading.Lock()
        self._folder = Path(
            tempfile.mkdtemp(prefix="art-trainer-")
        )  # 0700: only this user reaches the socket
        self._log_path = self._folder / "workers.log"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._folder / "control.sock"))
        listener.listen(1)
        listener.settimeout(1.0)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        address = master or f"127.0.0.1:{_free_port()}"
        command = worker_command(
            self.base_model,
            self.lora,
            processes=processes,
            nodes=nodes,
            node_rank=0,
            master=address,
            device="cuda" if gpu_ids else "cpu",
            engine=engine,
            seed=seed,
            max_seq_len=max_seq_len,
        ) + [f"--socket={self._folder / 'control.sock'}"]
        if nodes > 1:
            join = worker_command(
                self.base_model, self.lora, processes=processes, nodes=nodes, node_rank=1, master=address,
                device="cuda" if gpu_ids else "cpu", engine=engine, seed=seed, max_seq_len=max_seq_len,
            )  # fmt: skip
            log.info(
                "trainer node 0 of %d waits at %s; on each other host run: %s", nodes, address, " ".join(join)
            )
        with self._log_path.open("wb") as out:
            self._process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _stop, self._process, self._folder)
        try:
            self._conn = self._accept(listener, start_timeout_s)
            hello = receive(self._conn)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.engine = f"{hello['engine']}+fsdp2x{processes}"
        self.load_seconds = float(hello["load_seconds"])
        self._step = int(hello["step"])

    # --- the Trainer interface ------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._call("set_step", step=int(value))

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> Metrics:
        answer = self._call(
            "train_step",
            groups=[g.model_dump(mode="json") for g in groups],
            config=config.model_dump(mode="json", exclude_unset=True),
        )
        for group, fractions in zip(groups, answer["trajectory_metrics"], strict=True):
            for trajectory, values in zip(group.trajectories, fractions, strict=True):
                trajectory.metrics.update(values)
        return answer["metrics"]

    def sft_step(self, trajectories: list[Trajectory], config: SFTConfig) -> Metrics:
        answer = self._call(
            "sft_step",
            trajectories=[t.model_dump(mode="json") for t in trajectories],
            config=config.model_dump(mode="json"),
        )
        return answer["metrics"]

    def sft_batches(self, trajectories: list[Trajectory], config: SFTConfig) -> Iterator[list[Trajectory]]:
        from .trainer import sft_batches

        return sft_batches(trajectories, config)

    def save(self, directory: str | Path) -> Path:
        self._call("save", directory=str(directory))
        return Path(directory)

    def load(self, directory: str | Path) -> None:
        self._call("load", directory=str(directory))

    def logprobs_of(self, token_ids: list[int], temperature: float = 1.0, *, start: int = 1) -> list[float]:
        return self._call("logprobs_of", token_ids=list(token_ids), temperature=temperature, start=start)[
            "logprobs"
        ]

    def close(self) -> None:
        """Stop the processes (after finishing the command in flight)."""
        with self._lock:
            conn = getattr(self, "_conn", None)
            if conn is not None and self._process.poll() is None:
                try:
                    send(conn, {"op": "close"})
                    receive(conn)
                    self._process.wait(timeout=60)
                except (OSError, ConnectionError, subprocess.TimeoutExpired):
                    pass
            if conn is not None:
                conn.close()
                self._conn = None
        self._finalizer()

    # --- plumbing --------------------------------------------------------------------------------------------

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if getattr(self, "_conn", None) is None:
                raise TrainerProcessError("the sharded trainer is closed")
            try:
                send(self._conn, {"op": op, **fields})
                answer = receive(self._conn)
            except (OSError, ConnectionError) as error:
                raise TrainerProcessError(
                    f"the trainer processes stopped: {error}\n{self._log_tail()}"
                ) from error
        self._step = int(answer.get("step", self._step))
        if "error" in answer:
            kind = TokenizationError if answer["error"] == "TokenizationError" else TrainerProcessError
            raise kind(
                f"{answer['message']}"
                if kind is TokenizationError
                else f"{answer['error']}: {answer['message']}"
            )
        return answer

    def _accept(self, listener: socket.socket, timeout_s: float) -> socket.socket:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise TrainerProcessError(f"the trainer processes exited while loading\n{self._log_tail()}")
            try:
                conn, _ = listener.accept()
                conn.settimeout(None)
                return conn
            except TimeoutError:
                continue
        raise TrainerProcessError(
            f"the trainer processes did not start within {timeout_s:.0f} s\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def worker_command(
    base_model: str,
    lora: LoRAConfig,
    *,
    processes: int,
    nodes: int,
    node_rank: int,
    master: str,
    device: str,
    engine: str = "auto",
    seed: int = 0,
    max_seq_len: int = 2048,
) -> list[str]:
    """torchrun's command for one host's trainer processes (node 0 also gets `--socket`, added by the leader)."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"master must be 'host:port', not {master!r}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={processes}",
        f"--master-addr={host}",
        f"--master-port={port}",
        "-m",
        "art_adapters.training.worker",
        f"--base-model={base_model}",
        f"--lora={lora.model_dump_json()}",
        f"--device={device}",
        f"--engine={engine}",
        f"--seed={seed}",
        f"--max-seq-len={max_seq_len}",
    ]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(process: subprocess.Popen[bytes], folder: Path) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    shutil.rmtree(folder, ignore_errors=True)


__all__ = ["ShardedTrainer", "TrainerProcessError", "worker_command"]


def trainer_worker_command(argv: list[str] | None = None) -> int:
    """`art-adapters trainer-worker`: join a sharded trainer from another host (node 1..N-1 of its rendezvous)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="art-adapters trainer-worker",
        description="Run this host's share of a sharded trainer whose node 0 is an `art-adapters serve` (or a "
        "LocalBackend) started with the same --trainer-nodes and --trainer-master.",
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.node_rank < args.nodes:
        raise SystemExit(f"--node-rank must be 1..{args.nodes - 1} (node 0 is the backend's host)")
    command = worker_command(
        args.base_model,
        LoRAConfig.model_validate_json(args.lora),
        processes=args.processes,
        nodes=args.nodes,
        node_rank=args.node_rank,
        master=args.master,
        device=args.device,
        seed=args.seed,
    )
    return subprocess.call(command)
