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
    """`processes` trainer processes on this host (`gpu_ids`: one GPU each; none: CPU, gloo). More hosts join
    through torchrun's rendezvous (see README, "Past one GPU")."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        processes: int,
        gpu_ids: list[int] | None = None,
        engine: str = "auto",
        seed: int = 0,
        max_seq_len: int = 2048,
        start_timeout_s: float = 900.0,
    ) -> None:
        if processes < 1:
            raise ValueError(f"trainer processes must be >= 1, not {processes}")
        if gpu_ids and len(gpu_ids) != processes:
            raise ValueError(f"{processes} trainer processes need {processes} GPU ids, not {gpu_ids}")
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
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            "-m",
            "art_adapters.training.worker",
            f"--socket={self._folder / 'control.sock'}",
            f"--base-model={self.base_model}",
            f"--lora={self.lora.model_dump_json()}",
            f"--device={'cuda' if gpu_ids else 'cpu'}",
            f"--engine={engine}",
            f"--seed={seed}",
            f"--max-seq-len={max_seq_len}",
        ]
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


__all__ = ["ShardedTrainer", "TrainerProcessError"]
