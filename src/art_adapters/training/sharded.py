"""A Trainer that is N processes (FSDP2, `fsdp.py`), driven from the backend's process: the same methods as `Trainer`
(train_step, sft_step, save, load, logprobs_of, step), each sent to the processes' leader over a Unix socket in a
private folder. One setting chooses it: `LocalBackend(trainer_processes=N)`.

Faults end in an error, never a hang: a process that exits (an exception, a kill) takes the others down at once
and the call raises with the end of its log; a hung process makes its peers' collectives time out
(`collective_timeout_s`); a leader whose heartbeat stops is declared dead after `heartbeat_timeout_s`. A dead
trainer stays dead (`alive` is False; the backend replaces it from the last checkpoint). `close()` returns within
seconds whatever the processes do."""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from ..config import LoRAConfig, SFTConfig, ShardedTrainerOptions, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from . import launcher
from .launcher import Ranks, WorkerSpec, host_env
from .rendezvous import TOKEN_ENV, join_token
from .tokenize import TokenizationError
from .versions import FutureVersionError
from .wire import receive, send

log = logging.getLogger(__name__)
Metrics = dict[str, Any]
POLL_S = 0.25
SOCKET_PATH_MAX = 100  # bytes of a Unix socket's path (sun_path holds 108 on Linux, 104 on macOS)


class TrainerProcessError(RuntimeError):
    """The sharded trainer's processes failed (the message holds the end of their logs)."""


class ShardedTrainer:
    """`processes` trainer processes on this host (`gpu_ids`: one GPU each; none: CPU, gloo). With `nodes > 1`,
    this host is node 0 and rank 0 serves the rendezvous at `master` ("host:port", reachable by the others,
    which join with the command this logs; every host needs the same ART_ADAPTERS_TRAINER_TOKEN). `options`:
    activation checkpointing, HSDP across hosts, timeouts. `worker_module`: the module each process runs (default
    `launcher.WORKER_MODULE`; tests wrap the worker in one that injects faults). `adapters`: each process holds
    a per-agent trainer with these agents' adapters (`sharded_agents.ShardedPerAgentTrainer` sets it)."""

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
        logprob_chunk_tokens: int | None = None,
        options: ShardedTrainerOptions | None = None,
        start_timeout_s: float = 900.0,
        worker_module: str | None = None,
        adapters: list[str] | None = None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"trainer processes must be >= 1, not {processes}")
        if logprob_chunk_tokens is not None and logprob_chunk_tokens < 0:
            raise ValueError(
                f"logprob_chunk_tokens must be >= 0 (0 or None: unchunked), not {logprob_chunk_tokens}"
            )
        if gpu_ids and len(gpu_ids) != processes:
            raise ValueError(f"{processes} trainer processes need {processes} GPU ids, not {gpu_ids}")
        if nodes > 1 and not master:
            raise ValueError(
                "a trainer on several hosts needs master='host:port' (this host, reachable by the others)"
            )
        if engine == "unsloth":
            log.warning(
                "the sharded trainer runs PEFT + transformers under FSDP2 (Unsloth's route is not used)"
            )
        options = options or ShardedTrainerOptions()
        token = join_token(required=nodes > 1)
        self.base_model = str(base_model)
        self.lora = lora or LoRAConfig()
        self.processes = processes
        self.max_seq_len = (
            max_seq_len  # each process's Trainer caps every step by it, as the one-process trainer
        )
        self.heartbeat_timeout_s = options.heartbeat_timeout_s
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._conn: socket.socket | None = None
        spec = WorkerSpec(
            base_model=self.base_model,
            lora=self.lora,
            processes=processes,
            nodes=nodes,
            device="cuda" if gpu_ids else "cpu",
            seed=seed,
            max_seq_len=max_seq_len,
            logprob_chunk_tokens=logprob_chunk_tokens or 0,
            activation_checkpointing=options.activation_checkpointing,
            collective_timeout_s=options.collective_timeout_s,
            hsdp=options.hsdp,
            adapters=None if adapters is None else tuple(adapters),
        )
        self._folder = _private_folder()  # 0700: only this user reaches the socket
        store = f"tcp:{master}" if nodes > 1 else f"file:{self._folder / 'store'}"
        for node in range(1, nodes):
            log.info(
                "trainer node 0 of %d waits at %s; with %s set to the same token, on host %d run: %s",
                nodes,
                master,
                TOKEN_ENV,
                node,
                spec.join_command(node, str(master)),
            )
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self._folder / "control.sock"))
            listener.listen(1)
            self._ranks = Ranks(
                spec.argv(store, worker_module or launcher.WORKER_MODULE)
                + [f"--socket={self._folder / 'control.sock'}"],
                processes=processes,
                node_rank=0,
                nodes=nodes,
                folder=self._folder,
                env=host_env(nodes == 1, token, gpu_ids),
            )
        except BaseException:
            listener.close()
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _stop, self._ranks, self._folder)
        try:
            self._conn = self._accept(listener, start_timeout_s)
            hello = self._answer(deadline=time.monotonic() + start_timeout_s)
            if "error" in hello:
                self._fail(f"the trainer processes refused to start: {hello['error']}: {hello['message']}")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.engine = f"{hello['engine']}+fsdp2x{processes * nodes}"
        self.load_seconds = float(hello["load_seconds"])
        self._step = int(hello["step"])

    # --- the Trainer interface ------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._call("set_step", step=int(value))

    @property
    def alive(self) -> bool:
        """False once a process failed or the trainer was closed (its state is then only what was saved)."""
        return self._dead is None and self._ranks.exited() is None

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig, **more: Any) -> Metrics:
        """`more`: fields the command carries besides the groups and config (a per-agent step's routes)."""
        answer = self._call(
            "train_step",
            groups=[g.model_dump(mode="json") for g in groups],
            config=config.model_dump(mode="json", exclude_unset=True),
            **more,
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
        from .prepare import sft_batches

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

    def memory(self, *, probe: bool = True) -> list[dict[str, Any]]:
        """Each process's peak RSS and (when a probe was on) the most its frozen weights held since the last call;
        `probe` turns the probe on for the next commands."""
        return self._call("memory", probe=probe)["ranks"]

    def close(self) -> None:
        """Stop the processes: a clean close when they answer within seconds, SIGKILL otherwise. Returns within
        about 10 s whatever they do; a call in flight in another thread raises."""
        idle = self._lock.acquire(timeout=0.5)
        try:
            if idle and self._dead is None and self._conn is not None and self._ranks.exited() is None:
                try:
                    self._conn.settimeout(2.0)
                    send(self._conn, {"op": "close"})
                    self._answer(deadline=time.monotonic() + 4.0)
                    self._ranks.wait_all(2.0)
                except (OSError, ConnectionError, TrainerProcessError):
                    pass
            self._dead = self._dead or "closed"
            self._ranks.kill()
            if self._conn is not None:
                self._conn.close()
        finally:
            if idle:
                self._lock.release()
        self._finalizer()

    # --- plumbing --------------------------------------------------------------------------------------------

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if self._dead is not None or self._conn is None:
                raise TrainerProcessError(
                    f"the sharded trainer is {self._dead or 'closed'}: it cannot run {op!r}"
                )
            try:
                self._conn.settimeout(self.heartbeat_timeout_s)
                send(self._conn, {"op": op, **fields})
            except OSError as error:
                self._fail(f"the trainer's leader stopped taking commands ({error})")
            answer = self._answer()
        self._step = int(answer.get("step", self._step))
        self._heard(answer)
        if "error" in answer:
            if answer["error"] == "TokenizationError":
                raise TokenizationError(answer["message"])
            if answer["error"] == "FutureVersionError":
                raise FutureVersionError(answer["message"])
            raise TrainerProcessError(f"{answer['error']}: {answer['message']}")
        return answer

    def _heard(self, answer: dict[str, Any]) -> None:
        """What a subclass keeps of every answer, an error's too (the per-agent trainer: the agents held)."""

    def _answer(self, deadline: float | None = None) -> dict[str, Any]:
        """The leader's next answer (heartbeats skipped), watching every process meanwhile."""
        assert self._conn is not None
        heard = time.monotonic()
        while True:
            if self._dead is not None:
                self._fail(f"the sharded trainer was {self._dead} during the call")
            try:
                readable, _, _ = select.select([self._conn], [], [], POLL_S)
            except (OSError, ValueError):  # closed by close() in another thread
                self._fail("the sharded trainer was closed during the call")
            now = time.monotonic()
            if readable:
                try:
                    message = receive(self._conn)
                except (OSError, ConnectionError) as error:
                    self._ranks.wait_all(2.0)  # the exit codes say more than the socket
                    self._fail(
                        f"the trainer's leader went away ({error}); {self._exits()}", first=self._culprit()
                    )
                if "heartbeat" not in message:
                    return message
                heard = now
                continue
            exited = self._ranks.exited()
            if exited is not None:
                rank, code = exited
                self._fail(f"trainer rank {rank} exited with {_exit_text(code)}", first=rank)
            if deadline is None and now - heard > self.heartbeat_timeout_s:
                self._fail(f"the trainer's leader sent no heartbeat for {self.heartbeat_timeout_s:.0f} s")
            if deadline is not None and now > deadline:
                self._fail("the trainer processes did not answer in time")

    def _accept(self, listener: socket.socket, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        listener.settimeout(POLL_S)
        while time.monotonic() < deadline:
            exited = self._ranks.exited()
            if exited is not None:
                self._fail(
                    f"trainer rank {exited[0]} exited with {_exit_text(exited[1])} while starting",
                    first=exited[0],
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            return conn
        self._fail(f"the trainer processes did not start within {timeout_s:.0f} s")

    def _exits(self) -> str:
        codes = [(rank, p.poll()) for rank, p in self._ranks.processes.items()]
        return ", ".join(
            f"rank {rank} exited with {_exit_text(code)}" if code is not None else f"rank {rank} still ran"
            for rank, code in codes
        )

    def _culprit(self) -> int | None:
        """The rank most likely to have failed first: one killed by a signal, else a follower that failed."""
        codes = {rank: p.poll() for rank, p in self._ranks.processes.items()}
        signalled = [rank for rank, code in codes.items() if code is not None and code < 0]
        failed = [rank for rank, code in codes.items() if code and rank != 0]
        return (signalled or failed or [None])[0]

    def _fail(self, why: str, first: int | None = None) -> NoReturn:
        """Take every process down, remember the trainer is dead, raise with their logs."""
        self._dead = self._dead or "dead"
        self._ranks.kill()
        raise TrainerProcessError(f"{why}\n{self._ranks.log_tail(first)}")


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def _private_folder() -> Path:
    """A new folder only this user reaches (0700), for the control socket and the store: under the temporary
    directory, or under /tmp when that path is too long for a Unix socket (a long TMPDIR on a cluster)."""
    folder = Path(tempfile.mkdtemp(prefix="art-trainer-"))
    if len(os.fsencode(folder / "control.sock")) <= SOCKET_PATH_MAX:
        return folder
    folder.rmdir()
    return Path(tempfile.mkdtemp(prefix="art-trainer-", dir="/tmp"))


def _stop(ranks: Ranks, folder: Path) -> None:
    ranks.kill()
    shutil.rmtree(folder, ignore_errors=True)


__all__ = ["ShardedTrainer", "TrainerProcessError"]
