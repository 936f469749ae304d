"""One process of a sharded trainer (started by `launcher.py`): join the group, prove the token and compare start-up
facts (`rendezvous.py`), load this process's shards, then run commands. The leader (rank 0) takes each command
from the backend over a Unix socket, every process runs it on its share, and the leader answers; while a command
runs the leader sends a heartbeat every few seconds, so the backend tells a slow step from a frozen leader.

An error every process raises alike (`AgreedError`: a refused batch, a checkpoint that cannot be read) is answered
and the group goes on; any other exception leaves the group out of step, so the process logs it and exits at once,
and the launcher takes the others down. JSON only; nothing is pickled."""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from typing import Any, NoReturn

from ..config import TRAINER_HEARTBEAT_S, LoRAConfig, SFTConfig, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from .agent_steps import TableRoute
from .parallel import AgreedError, Parallel, all_gather_bytes, broadcast_bytes, join
from .per_agent import PerAgentTrainer
from .rendezvous import TOKEN_ENV, check_group, facts
from .trainer import Trainer
from .wire import receive, send

HEARTBEAT_S = TRAINER_HEARTBEAT_S
IDLE_PING_S = 300.0  # the leader wakes the control group this often while the backend sends nothing
PARENT_POLL_S = 2.0  # how often a process checks that the backend (or launcher) that started it still runs


def run(trainer: Trainer, command: dict[str, Any]) -> dict[str, Any]:
    """One command on this process's trainer; the answer the leader sends back."""
    op = command["op"]
    if op == "train_step":
        groups = [TrajectoryGroup.model_validate(g) for g in command["groups"]]
        if isinstance(trainer, PerAgentTrainer):  # the backend applied the PerAgent rule: each call's adapter
            trainer.route = TableRoute(command["routes"])
        metrics = trainer.train_step(groups, TrainConfig.model_validate(command["config"]))
        fractions = [
            [{k: v for k, v in t.metrics.items() if k.endswith("_token_fraction")} for t in g.trajectories]
            for g in groups
        ]
        return {"metrics": metrics, "trajectory_metrics": fractions}
    if op == "sft_step":
        trajectories = [Trajectory.model_validate(t) for t in command["trajectories"]]
        return {"metrics": trainer.sft_step(trajectories, SFTConfig.model_validate(command["config"]))}
    if op == "save":
        trainer.save(command["directory"])
        return {}
    if op == "load":
        if isinstance(trainer, PerAgentTrainer):  # the backend chose them (only this rank 0 reads the disk)
            trainer.load_agents(command["directory"], command["agents"])
        else:
            trainer.load(command["directory"])
        return {}
    if op == "adapter_logprobs" and isinstance(trainer, PerAgentTrainer):
        ids = command["token_ids"]
        return {"logprobs": trainer.adapter_logprobs(command["adapter"], ids, command["temperature"])}
    if op == "logprobs_of":
        logprobs = trainer.logprobs_of(command["token_ids"], command["temperature"], start=command["start"])
        return {"logprobs": logprobs}
    if op == "set_step":
        trainer.step = int(command["step"])
        return {}
    if op == "memory":
        return {"ranks": _memory(trainer, bool(command.get("probe", True)))}
    if op == "close":
        return {}
    raise ValueError(f"unknown trainer command {op!r}")


def _memory(trainer: Trainer, probe: bool) -> list[dict[str, Any]]:
    """Every process's memory: peak RSS, and (with the probe on) the most its frozen weights held during the
    commands since the last call; `probe` turns the probe on for the next commands."""
    import resource

    from .fsdp import WeightProbe, frozen_weight_bytes

    current = getattr(trainer, "_weight_probe", None)
    mine = {
        "rank": trainer.parallel.rank if trainer.parallel else 0,
        "peak_rss_bytes": _peak_rss_bytes(resource),
        "resident_weight_bytes_peak": current.peak if current is not None else None,
        "frozen_weight_bytes": frozen_weight_bytes(trainer.model),
    }
    if isinstance(trainer, PerAgentTrainer):
        mine["adapter_state_bytes"] = trainer.state_bytes()
    if trainer.device.type == "cuda":
        import torch

        mine["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
    if current is not None:
        current.remove()
        trainer._weight_probe = None  # type: ignore[attr-defined]
    if probe:
        trainer._weight_probe = WeightProbe(trainer.scorer, trainer.model)  # type: ignore[attr-defined]
    if trainer.parallel is None:
        return [mine]
    gathered = all_gather_bytes(json.dumps(mine).encode(), trainer.parallel, group=trainer.parallel.bounded)
    return [json.loads(raw) for raw in gathered]


def _peak_rss_bytes(resource: Any) -> int:
    """This process's peak RSS since it started (Linux: VmHWM; ru_maxrss would also count the RSS of the process
    that forked it, which Linux carries across exec)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Heartbeat:
    """While a command runs, the leader tells the backend it is alive every HEARTBEAT_S; `answer` ends it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="art-trainer-heartbeat")

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(HEARTBEAT_S + 1)

    def _beat(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            with self.lock:
                if self.done.is_set():
                    return
                try:
                    send(self.conn, {"heartbeat": time.time()})
                except OSError:
                    return


def serve(trainer: Trainer, parallel: Parallel, conn: socket.socket | None) -> bool:
    """Run commands until `close` (or until the backend's socket closes: then True)."""
    while True:
        payload = json.dumps(_next_command(conn)).encode() if conn is not None else None
        command = json.loads(broadcast_bytes(payload, parallel))
        if command["op"] == "ping":
            continue
        beat = Heartbeat(conn) if conn is not None else nullcontext()
        with beat:
            try:
                answer = run(trainer, command)
            except AgreedError as error:
                answer = {"error": error.kind, "message": error.message}
            except BaseException:  # the group is out of step: end this process, the launcher ends the rest
                abort(f"rank {parallel.rank} failed in {command['op']!r}")
            answer["step"] = trainer.step
            if isinstance(trainer, PerAgentTrainer):
                answer["agents"] = trainer.agents
            if conn is not None:
                beat.done.set()  # type: ignore[union-attr]
                with beat.lock:  # type: ignore[union-attr]
                    try:
                        send(conn, answer)
                    except OSError:
                        if not command.get("gone"):
                            raise
        if command["op"] == "close":
            return bool(command.get("gone"))


def _next_command(conn: socket.socket) -> dict[str, Any]:
    """The backend's next command; a ping when it sent none for IDLE_PING_S, close when it went away."""
    readable, _, _ = select.select([conn], [], [], IDLE_PING_S)
    if not readable:
        return {"op": "ping"}
    try:
        return receive(conn)
    except (OSError, ConnectionError):
        return {"op": "close", "gone": True}


def watch_parent(folder: str | None = None, poll_s: float = PARENT_POLL_S) -> None:
    """Exit (in a daemon thread) once the process that started this one is gone: a backend or launcher killed
    with SIGKILL closes nothing, and a rank blocked in a collective would otherwise outlive it. `folder`: the
    backend's private folder (the leader's), removed then. A rank frozen by SIGSTOP runs no code, so it stays
    until it is continued or killed."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        _remove_private(folder)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="art-trainer-parent").start()


def _remove_private(folder: str | None) -> None:
    if folder is not None and os.path.basename(folder).startswith("art-trainer-"):
        shutil.rmtree(folder, ignore_errors=True)


def _orphaned(parent: int, wait_s: float) -> bool:
    """Whether the process that started this one is gone (waiting up to `wait_s`: its socket closes as it dies,
    a moment before this process is handed to another parent)."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def abort(why: str) -> NoReturn:
    print(f"{why}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default=None, help="the backend's Unix socket (node 0's rank 0 connects)")
    parser.add_argument("--store", required=True, help="file:PATH (one host) or tcp:HOST:PORT")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1, help="processes per host")
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--lora", default="{}", help="LoRAConfig as JSON")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engine", default="peft")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--logprob-chunk-tokens", type=int, default=0)
    parser.add_argument("--activation-checkpointing", type=int, default=1)
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    parser.add_argument("--hsdp", type=int, default=0)
    parser.add_argument("--adapters", default=None, help="per-agent: the agents' adapters to hold, as JSON")
    args = parser.parse_args(argv)
    adapters = None if args.adapters is None else [str(a) for a in json.loads(args.adapters)]
    parent = os.getppid()
    watch_parent(os.path.dirname(args.socket) if args.socket else None)
    parallel = join(
        args.store,
        args.device,
        nodes=args.nodes,
        hsdp=bool(args.hsdp),
        collective_timeout_s=args.collective_timeout,
    )
    conn = None
    if parallel.leader:
        if args.socket is None:
            raise SystemExit(
                "the trainer's rank 0 runs on the backend's host (node 0), which passes --socket"
            )
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(args.socket)
    try:
        started = time.perf_counter()
        mine = facts(
            args.base_model,
            args.lora,
            engine=args.engine,
            device=args.device,
            max_seq_len=args.max_seq_len,
            processes_per_node=args.processes,
            hsdp=bool(args.hsdp),
            adapters=adapters,
        )
        check_group(parallel, os.environ.get(TOKEN_ENV, ""), mine)
        device = f"cuda:{parallel.local_rank}" if args.device == "cuda" else "cpu"
        per_agent: dict[str, Any] = {}
        if (
            adapters is not None
        ):  # a rebuild's temporary checkpoint goes in the backend's folder, removed with it
            scratch = os.path.dirname(args.socket) if args.socket else None
            per_agent = {"per_agent": None, "adapters": adapters, "scratch": scratch}
        trainer = (Trainer if adapters is None else PerAgentTrainer)(
            args.base_model,
            LoRAConfig.model_validate_json(args.lora),
            engine="peft",
            **per_agent,
            device=device,
            seed=args.seed,
            max_seq_len=args.max_seq_len,
            gradient_checkpointing=bool(args.activation_checkpointing),
            logprob_chunk_tokens=args.logprob_chunk_tokens,
            parallel=parallel,
        )
        seconds = time.perf_counter() - started
    except Exception as error:  # refused (token, mismatch) or failed to load: the backend hears why
        if conn is not None:
            send(conn, {"error": type(error).__name__, "message": str(error)})
        abort(f"rank {parallel.rank} could not start")
    if conn is not None:
        send(conn, {"ready": True, "engine": trainer.engine, "load_seconds": seconds, "step": 0})
    gone = serve(trainer, parallel, conn)
    if conn is not None:
        conn.close()
        if gone and _orphaned(parent, wait_s=2.0):  # the backend died: nobody else removes its folder
            _remove_private(os.path.dirname(args.socket))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the others are done too: nothing left to wait for in the process group's teardown


if __name__ == "__main__":
    main()
