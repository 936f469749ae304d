"""Where an inference request goes: every call of one rollout to the same engine, so a multi-turn rollout finds its
prefix in that engine's cache. The recording client names the rollout (`x-art-rollout`, an opaque key per
trajectory); the gateway hashes it to one of the engines it serves from: the managed server's data-parallel
replicas (vLLM's `X-data-parallel-rank` header) and the vLLM servers of other hosts (`RemoteEngine`). Rendezvous
hashing: adding or losing an engine moves only the rollouts that were on it."""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ..calls import ROLLOUT_HEADER

if TYPE_CHECKING:
    from .config import RemoteEngine

DP_RANK_HEADER = "x-data-parallel-rank"
__all__ = ["DP_RANK_HEADER", "ROLLOUT_HEADER", "PeerEngine", "Upstream", "pick", "route"]


def pick(key: str, choices: int) -> int:
    """The engine (0..choices-1) a rollout key goes to: the highest hash of (key, engine)."""
    return max(range(choices), key=lambda i: hashlib.sha256(f"{key}/{i}".encode()).digest())


@dataclass
class Upstream:
    base_url: str
    api_key: str
    headers: dict[str, str]
    peer: PeerEngine | None = None


def route(server: Any, rollout: str | None) -> Upstream:
    """The engine for a request of `rollout` (None: any, at random) among the managed server and its peers."""
    members: list[PeerEngine | None] = [None, *(p for p in getattr(server, "peers", []) if p.healthy)]
    if rollout:
        chosen = members[pick(rollout, len(members))]
    else:
        chosen = random.choice(members)
    replicas = server.config.replicas if chosen is None else chosen.replicas
    headers = {DP_RANK_HEADER: str(pick(f"{rollout}/replica", replicas))} if rollout and replicas > 1 else {}
    if chosen is None:
        return Upstream(server.base_url, server.api_key, headers)
    return Upstream(chosen.base_url, chosen.api_key, headers, chosen)


class PeerEngine:
    """A vLLM server on another host that serves this backend's models too: every adapter version is loaded there
    before the gateway routes to it (the server sees the backend's folder through a shared filesystem, at the same
    path or under `path_map`)."""

    def __init__(self, spec: RemoteEngine) -> None:
        self.base_url = spec.url.rstrip("/")
        self.api_key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
        self.replicas = spec.replicas
        self.path_map = dict(spec.path_map)
        self.healthy = True
        self.loras: dict[str, str] = {}

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def remote_path(self, path: Path) -> str:
        text = str(path)
        for here, there in self.path_map.items():
            if text == here or text.startswith(here.rstrip("/") + "/"):
                return there.rstrip("/") + text[len(here.rstrip("/")) :]
        return text

    async def load_lora(self, name: str, path: Path) -> None:
        if name in self.loras:
            return
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.remote_path(path)})
        self.loras[name] = self.remote_path(path)

    async def unload_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is not None:
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
            response = await client.post(f"{self.root_url}{path}", json=body, headers=headers)
        if response.status_code >= 400:
            raise httpx.HTTPStatusError(
                f"{self.root_url}{path} answered {response.status_code}: {response.text[:300]}",
                request=response.request,
                response=response,
            )


async def load_on_peers(peers: list[PeerEngine], name: str, path: Path) -> None:
    """Load a version on every healthy peer; a peer that cannot is taken out of routing (and says why)."""
    import logging

    for peer in peers:
        if not peer.healthy:
            continue
        try:
            await peer.load_lora(name, path)
        except (httpx.HTTPError, OSError) as error:
            peer.healthy = False
            logging.getLogger(__name__).error(
                "inference engine %s could not load %s (%s): no longer routed to", peer.base_url, name, error
            )


async def unload_on_peers(peers: list[PeerEngine], name: str) -> None:
    import logging

    for peer in peers:
        try:
            await peer.unload_lora(name)
        except (httpx.HTTPError, OSError) as error:
            logging.getLogger(__name__).warning(
                "inference engine %s could not unload %s: %s", peer.base_url, name, error
            )
