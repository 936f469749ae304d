"""A sharded trainer's processes, started by torchrun (`python -m torch.distributed.run ... -m
art_adapters.training.worker`): the leader takes each command from the backend over a Unix socket, every process
runs it on its share, and the leader answers. Commands and answers are JSON; nothing is pickled."""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
from typing import Any

import torch.distributed as dist

from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from .parallel import Parallel, broadcast_bytes, init_from_env
from .trainer import Trainer

_HEADER = struct.Struct("!Q")


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, default=_jsonable).encode()
    conn.sendall(_HEADER.pack(len(data)) + data)


def receive(conn: socket.socket) -> dict[str, Any]:
    size = _HEADER.unpack(_exactly(conn, _HEADER.size))[0]
    return json.loads(_exactly(conn, size))


def _exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the backend closed the trainer's socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def run(trainer: Trainer, command: dict[str, Any]) -> dict[str, Any]:
    """One command on this process's trainer; the answer the leader sends back."""
    op = command["op"]
    if op == "train_step":
        groups = [TrajectoryGroup.model_validate(g) for g in command["groups"]]
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
        trainer.load(command["directory"])
        return {}
    if op == "logprobs_of":
        return {
            "logprobs": trainer.logprobs_of(
                command["token_ids"], command["temperature"], start=command["start"]
            )
        }
    if op == "set_step":
        trainer.step = int(command["step"])
        return {}
    if op == "close":
        return {}
    raise ValueError(f"unknown trainer command {op!r}")


def serve(trainer: Trainer, parallel: Parallel, conn: socket.socket | None) -> None:
    control = dist.new_group(backend="gloo")  # commands travel as CPU tensors, whatever the training backend
    while True:
        payload = json.dumps(receive(conn)).encode() if conn is not None else None
        command = json.loads(broadcast_bytes(payload, parallel, control))
        try:
            answer = run(trainer, command)
        except Exception as error:  # deterministic errors (a bad batch) happen on every process alike
            answer = {"error": type(error).__name__, "message": str(error)}
        answer["step"] = trainer.step
        if conn is not None:
            send(conn, answer)
        if command["op"] == "close":
            return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default=None, help="the backend's Unix socket (node 0's leader connects)")
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--lora", default="{}", help="LoRAConfig as JSON")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engine", choices=["auto", "unsloth", "peft"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    args = parser.parse_args(argv)

    parallel = init_from_env(args.device)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if args.device == "cuda" else "cpu"
    trainer = Trainer(
        args.base_model,
        LoRAConfig.model_validate(json.loads(args.lora)),
        engine=args.engine,
        device=device,
        seed=args.seed,
        max_seq_len=args.max_seq_len,
        parallel=parallel,
    )
    conn = None
    if parallel.leader:
        if args.socket is None:
            raise SystemExit(
                "the trainer's rank 0 runs on the backend's host (node 0), which passes --socket"
            )
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(args.socket)
        send(conn, {"ready": True, "engine": trainer.engine, "load_seconds": trainer.load_seconds, "step": 0})
    try:
        serve(trainer, parallel, conn)
    finally:
        if conn is not None:
            conn.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
