"""Who may join a sharded trainer, checked before anything is loaded or sent: every process proves it holds the join
token (HMAC over every process's fresh nonce: a node that joins the store without the token learns nothing and
stops the run), then the processes compare what they were started with (base model, LoRA, engine, sequence length,
library versions) and refuse a mismatch by name.

On one host the token is minted by the backend and passed in the environment; across hosts every host is given the
same token (`ART_ADAPTERS_TRAINER_TOKEN`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from importlib import metadata
from typing import Any

from .parallel import Parallel, all_gather_bytes

TOKEN_ENV = "ART_ADAPTERS_TRAINER_TOKEN"


class JoinRefused(RuntimeError):
    """A process of the group did not prove the token, or was started differently (the message names it)."""


def facts(
    base_model: str,
    lora_json: str,
    *,
    engine: str,
    device: str,
    max_seq_len: int,
    processes_per_node: int,
    hsdp: bool,
    adapters: list[str] | None = None,
) -> dict[str, Any]:
    """What every process of one trainer must agree on (`adapters`: a per-agent trainer's starting agents)."""
    from pathlib import Path

    from .weights import weights_fingerprint

    folder = Path(base_model)
    config = json.loads((folder / "config.json").read_text())
    versions = {}
    for package in ("art-adapters", "torch", "transformers", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "base model config": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "base model weights": weights_fingerprint(folder),
        "LoRA config": json.loads(lora_json),
        "engine": engine,
        "device": device,
        "max sequence length": max_seq_len,
        "processes per node": processes_per_node,
        "HSDP": hsdp,
        "per-agent adapters": adapters,
        "library versions": versions,
    }


def check_group(parallel: Parallel, token: str, mine: dict[str, Any]) -> None:
    """Every process calls this right after joining; raises JoinRefused on every process when the group is wrong."""
    nonces = all_gather_bytes(secrets.token_bytes(32), parallel, limit=32)
    transcript = b"".join(nonces)
    proofs = all_gather_bytes(_proof(token, parallel.rank, transcript), parallel, limit=64)
    per_node = parallel.world // parallel.nodes
    strangers = [
        f"rank {rank} (node {rank // per_node})"
        for rank, proof in enumerate(proofs)
        if not hmac.compare_digest(proof, _proof(token, rank, transcript))
    ]
    if strangers:
        raise JoinRefused(
            f"{', '.join(strangers)} did not prove the trainer's join token: set the same {TOKEN_ENV} on every "
            "host (a process without it may be a stranger on the trainer's network)"
        )
    everyone = [
        json.loads(raw) for raw in all_gather_bytes(json.dumps(mine, sort_keys=True).encode(), parallel)
    ]
    for rank, theirs in enumerate(everyone):
        for field, value in everyone[0].items():
            if theirs.get(field) != value:
                raise JoinRefused(
                    f"rank {rank} (node {rank // per_node}) was started with a different {field}: "
                    f"{_short(theirs.get(field))} where node 0 has {_short(value)}"
                )


def join_token(required: bool) -> str:
    """The token from the environment; a fresh one where none is set and none is required (one host)."""
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        return token
    if required:
        raise ValueError(
            f"a trainer on several hosts needs a join token: set {TOKEN_ENV} to the same secret on every host "
            "(e.g. `openssl rand -hex 32`)"
        )
    return secrets.token_hex(32)


def _proof(token: str, rank: int, transcript: bytes) -> bytes:
    return hmac.new(
        token.encode(), f"art-trainer-join:{rank}:".encode() + transcript, hashlib.sha256
    ).digest()


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:200] + "..."
