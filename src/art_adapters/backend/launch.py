"""Running the backend server: the bind check (no key beyond loopback), `serve(...)` and `art-adapters serve`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from ..config import ShardedTrainerOptions
from ..http_limits import ConnectionLimits, uvicorn_config
from ..inference.requests import RequestLimits
from ..untrusted import is_loopback
from .base import Backend
from .server import DEFAULT_MAX_BODY_BYTES, create_app

API_KEY_ENV = "ART_ADAPTERS_API_KEY"
INFERENCE_KEY_ENV = "ART_ADAPTERS_INFERENCE_KEY"
log = logging.getLogger("art_adapters.server")


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key."""
    if not api_key and not is_loopback(host):
        raise SystemExit(
            f"art-adapters serve: refusing to listen on {host!r} without an API key. Anyone who can reach it could "
            f"train and query your models. Pass --api-key KEY (or set {API_KEY_ENV}), or bind 127.0.0.1."
        )


def serve(
    host: str = "127.0.0.1",
    port: int = 7999,
    api_key: str | None = None,
    path: str = ".art",
    *,
    inference_key: str | None = None,
    allowed_base_models: Iterable[str] = (),
    backend: Backend | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    limits: RequestLimits | None = None,
    trainer_processes: int | None = None,
    trainer_gpu_ids: list[int] | None = None,
    trainer_nodes: int = 1,
    trainer_master: str | None = None,
    record: str | None = None,
    connections: ConnectionLimits | None = None,
    trainer_options: ShardedTrainerOptions | None = None,
    inference_gpu_ids: list[int] | None = None,
    replicas: int | None = None,
    tensor_parallel_size: int | None = None,
    max_seq_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    max_loras: int | None = None,
) -> None:
    """Serve `backend` (default: a LocalBackend on `path`, built only now) until interrupted. With a certificate
    and key it speaks HTTPS (otherwise the key crosses the network in clear: prefer a tunnel or TLS). `limits`
    bound every inference request, at this server and at the engine's gateway; `connections` the connections it
    holds and how long it waits for a slow client. SIGTERM ends it within a bounded time: connections still open
    after 10 s are closed, steps in flight get 120 s. `record` (a store URL: sqlite:///file.db or
    postgresql://...): record mode, every `/v1` call stored, `POST /rewards/{id}` open. On CUDA the engine and
    trainer start from the memory plan (`art-adapters plan`); `inference_gpu_ids`, `replicas`,
    `tensor_parallel_size`, `max_seq_len` and `gpu_memory_utilization` override its decisions. `max_loras`: the
    adapters the engine holds at once (per-agent adapters: each agent's is one; unset, a client's fixed agent list
    sizes it at the first registration)."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    inference_key = inference_key or os.environ.get(INFERENCE_KEY_ENV) or None
    check_bind(host, api_key)
    if inference_key and not api_key:
        raise SystemExit("art-adapters serve: --inference-key needs an admin --api-key too")
    if inference_key and inference_key == api_key:
        raise SystemExit("art-adapters serve: the inference key must differ from the admin key")
    if not api_key:
        log.warning(
            "art-adapters serve: no API key, so every local user of this machine can train, delete and sample "
            "(web pages cannot: only loopback Host names are answered); set %s on a shared machine",
            API_KEY_ENV,
        )
    import uvicorn

    limits = limits or RequestLimits()
    if backend is None:
        from pydantic import ValidationError

        from ..inference import InferenceConfig
        from .local import LocalBackend

        given = {
            "gpu_ids": inference_gpu_ids or None,
            "replicas": replicas,
            "tensor_parallel_size": tensor_parallel_size,
            "max_model_len": max_seq_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_loras": max_loras,
        }  # only what was given counts as set: the plan decides the rest
        try:
            inference = InferenceConfig(limits=limits, **{k: v for k, v in given.items() if v is not None})
        except ValidationError as error:
            first = error.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            flag = {"gpu_ids": "inference-gpu", "max_model_len": "max-seq-len"}.get(
                field, field.replace("_", "-")
            )
            where = f"--{flag}: " if flag else ""
            raise SystemExit(f"art-adapters serve: {where}{first['msg']}") from None
        backend = LocalBackend(
            path=path,
            inference=inference,
            trainer_processes=trainer_processes,
            trainer_gpu_ids=trainer_gpu_ids,
            trainer_nodes=trainer_nodes,
            trainer_master=trainer_master,
            trainer_options=trainer_options,
        )
    app = create_app(
        backend,
        api_key=api_key,
        inference_key=inference_key,
        allowed_base_models=allowed_base_models,
        max_body_bytes=max_body_bytes,
        limits=limits,
        record=_recorder(record),
    )
    config = uvicorn_config(
        app,
        host=host,
        port=port,
        limits=connections,
        log_level=log_level,
        backlog=2048,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=10,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    uvicorn.Server(config).run()


RECORD_URL_ENV = "ART_ADAPTERS_RECORD_URL"  # the record store's URL, password included, off the command line


def record_url(argument: str | None, file: str | None) -> str | None:
    """The record store's URL: `--record URL` (warned when it holds a password: argv shows in `ps`), else
    `--record-file PATH` (its first line), else env ART_ADAPTERS_RECORD_URL; None for none of them."""
    import sys
    from pathlib import Path
    from urllib.parse import urlsplit

    if argument is not None and file is not None:
        raise SystemExit("art-adapters serve: give --record or --record-file, not both")
    if file is not None:
        try:
            lines = Path(file).read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise SystemExit(f"art-adapters serve: --record-file {file}: {error}") from error
        if not lines or not lines[0].strip():
            raise SystemExit(f"art-adapters serve: --record-file {file} is empty (one line: the store's URL)")
        return lines[0].strip()
    if argument is not None:
        try:
            password = urlsplit(argument).password
        except ValueError:
            password = None
        if password:
            print(
                "art-adapters serve: --record's URL holds a password, which every user of this machine sees in "
                f"`ps`: pass it in env {RECORD_URL_ENV} or a file (--record-file PATH) instead",
                file=sys.stderr,
            )
        return argument
    return os.environ.get(RECORD_URL_ENV) or None


def _recorder(url: str | None) -> object:
    if url is None:
        return None
    from ..capture.live import LiveRecorder

    return LiveRecorder(url)  # rewards are behind the server's admin key


def serve_command(argv: list[str] | None = None) -> None:
    """`art-adapters serve --host 127.0.0.1 --port 7999 [--api-key KEY] [--path .art]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="art-adapters serve", description="Expose a LocalBackend over HTTP."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7999)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"admin key, required beyond loopback; prefer env {API_KEY_ENV} (argv shows in `ps` to every user)",
    )
    parser.add_argument(
        "--inference-key",
        default=None,
        help=(
            "the key handed to rollout workers, opening only /v1/* inference (default: one is minted at start); "
            f"prefer env {INFERENCE_KEY_ENV}"
        ),
    )
    parser.add_argument(
        "--allow-base-model",
        action="append",
        default=[],
        metavar="PATH_OR_HUB_ID",
        help="a base model clients may register (repeatable); models already in --path are allowed too",
    )
    parser.add_argument("--path", default=".art", help="backend folder (default .art)")
    parser.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY_BYTES // 2**20)
    defaults = RequestLimits()
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="choices per inference request")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="output tokens per choice (default: the context length)"
    )
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=defaults.max_request_tokens,
        help="n x output tokens per inference request",
    )
    parser.add_argument(
        "--trainer-processes",
        type=int,
        default=None,
        help="train each step data-parallel on N processes (FSDP2; on CUDA GPUs 0..N-1 unless --trainer-gpu)",
    )
    parser.add_argument(
        "--trainer-gpu",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="a GPU the trainer uses (repeatable)",
    )
    parser.add_argument(
        "--trainer-nodes", type=int, default=1, help="hosts in the sharded trainer (this is node 0)"
    )
    parser.add_argument(
        "--trainer-master",
        default=None,
        metavar="HOST:PORT",
        help="node 0's rendezvous address, reachable by the others",
    )
    parser.add_argument(
        "--record",
        default=None,
        metavar="STORE_URL",
        help="record mode: store every /v1 call (sqlite:///file.db or postgresql://...); POST /rewards/{id}. "
        f"A URL with a password: prefer env {RECORD_URL_ENV} or --record-file (argv shows in `ps`)",
    )
    parser.add_argument(
        "--record-file",
        default=None,
        metavar="PATH",
        help=f"record mode with the store URL read from this file's first line (or set env {RECORD_URL_ENV})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=ConnectionLimits().max_connections,
        help="open connections at once (one more is answered 503)",
    )
    parser.add_argument(
        "--trainer-hsdp",
        action="store_true",
        help="several trainer hosts: shard within a host, replicate across hosts (FSDP2's HSDP)",
    )
    parser.add_argument(
        "--no-activation-checkpointing",
        action="store_true",
        help="keep the sharded trainer's activations instead of recomputing them (faster, more memory)",
    )
    parser.add_argument(
        "--trainer-collective-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a trainer process waits on its peers before the group is declared broken",
    )
    parser.add_argument(
        "--inference-gpu",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="a GPU the inference engine uses (repeatable; replicas x tensor-parallel-size of them)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engine replicas behind one server (vLLM data parallelism); each rollout sticks to one "
        "(default: the memory plan's on CUDA, else 1)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="GPUs per engine replica (replicas x N must equal the --inference-gpu ids; default: the plan's)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the longest sequence served and trained (vLLM's max_model_len, the trainer's max_seq_len; "
        "default: the plan's on CUDA, 2048 on the CPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vLLM's share of each inference GPU (default: the plan's)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters the engine holds at once (per-agent adapters: the shared one and each agent's, plus "
        "one loading; default 4, or 2 x (agents + 1) for a model that lists its agents)",
    )
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", default=None, help="... and this private key (PEM)")
    args = parser.parse_args(argv)
    serve(
        args.host,
        args.port,
        args.api_key,
        args.path,
        inference_key=args.inference_key,
        allowed_base_models=args.allow_base_model,
        max_body_bytes=args.max_body_mb * 2**20,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        limits=RequestLimits(
            max_n=args.max_n, max_tokens=args.max_tokens, max_request_tokens=args.max_request_tokens
        ),
        trainer_processes=args.trainer_processes,
        trainer_gpu_ids=args.trainer_gpu,
        trainer_nodes=args.trainer_nodes,
        trainer_master=args.trainer_master,
        record=record_url(args.record, args.record_file),
        connections=ConnectionLimits(max_connections=args.max_connections),
        trainer_options=ShardedTrainerOptions(
            hsdp=args.trainer_hsdp,
            activation_checkpointing=not args.no_activation_checkpointing,
            collective_timeout_s=args.trainer_collective_timeout,
        ),
        inference_gpu_ids=args.inference_gpu,
        replicas=args.replicas,
        tensor_parallel_size=args.tensor_parallel_size,
        max_seq_len=args.max_seq_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_loras=args.max_loras,
    )


if __name__ == "__main__":
    serve_command()
