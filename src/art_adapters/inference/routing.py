"""Where an inference request goes: every call of one rollout to the same engine, so a multi-turn rollout finds its
prefix in that engine's cache. The recording client names the rollout (`x-art-rollout`, an opaque key per
trajectory); the gateway hashes it to one of the engines it serves from: the managed server's data-parallel
replicas (vLLM's `X-data-parallel-rank` header) and the vLLM servers of other hosts (`RemoteEngine`). Rendezvous
hashing: adding or losing an engine moves only the rollouts that were on it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ..calls import ROLLOUT_HEADER

if TYPE_CHECKING:
    from .config import RemoteEngine

DP_RANK_HEADER = "x-data-parallel-rank"
UNLOAD_FAILURES = 3  # unloads failed in a row that take a peer out of routing
log = logging.getLogger(__name__)
__all__ = ["DP_RANK_HEADER", "ROLLOUT_HEADER", "PeerEngine", "Upstream", "choose", "pick", "route"]


def pick(key: str, choices: int) -> int:
    """The replica (0..choices-1) a rollout key goes to: the highest hash of (key, replica)."""
    return max(range(choices), key=lambda i: _weight(key, str(i)))


def _weight(key: str, identity: str) -> bytes:
    return hashlib.sha256(f"{key}/{identity}".encode()).digest()


MANAGED = "managed"  # the managed server's identity among the engines (a peer's is its URL)


def choose(key: str, identities: list[str]) -> int:
    """Rendezvous hashing: the index of the engine whose identity scores highest with `key`. An engine that leaves
    takes only its own keys elsewhere; one that joins takes only keys it now scores highest on."""
    return max(range(len(identities)), key=lambda i: _weight(key, identities[i]))


@dataclass
class Upstream:
    base_url: str
    api_key: str
    headers: dict[str, str]
    peer: PeerEngine | None = None


def route(server: Any, rollout: str | None, adapter: str | None = None) -> Upstream:
    """The engine for a request of `rollout` (None: any, at random) among the managed server and its healthy
    peers that hold `adapter` (None: any healthy peer)."""
    members: list[PeerEngine | None] = [None]
    members += [
        p for p in getattr(server, "peers", []) if p.healthy and (adapter is None or adapter in p.loras)
    ]
    if rollout:
        chosen = members[choose(rollout, [MANAGED if m is None else m.base_url for m in members])]
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
    path or under `path_map`). One that fails is taken out of routing (`healthy`) until it loads the versions
    served again (`revive`, tried at each publish); unloads run in the background, so no publish waits on one."""

    def __init__(self, spec: RemoteEngine) -> None:
        self.base_url = spec.url.rstrip("/")
        self.api_key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
        self.replicas = spec.replicas
        self.path_map = dict(spec.path_map)
        self.healthy = True
        self.loras: dict[str, str] = {}  # what it holds: name -> its path there
        self.unload_failures = 0  # in a row; UNLOAD_FAILURES of them take it out
        self._unloads: dict[str, asyncio.Task[None]] = {}
        self._reviving: asyncio.Task[None] | None = None

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def remote_path(self, path: Path, named: Path | None = None) -> str:
        """`path` as that host sees it: the form the user named (`named`) and the resolved one are each tried
        against `path_map`, the longest matching prefix first; unmapped, the resolved path."""
        prefixes = sorted(self.path_map, key=lambda here: len(here.rstrip("/")), reverse=True)
        for text in dict.fromkeys(str(p) for p in (named, path) if p is not None):
            for here in prefixes:
                base = here.rstrip("/")
                if text == here or text == base or text.startswith(base + "/"):
                    return self.path_map[here].rstrip("/") + text[len(base) :]
        return str(path)

    def take_out(self, why: str) -> None:
        if self.healthy:
            log.error("inference engine %s %s: no longer routed to", self.base_url, why)
        self.healthy = False

    async def load_lora(self, name: str, path: Path, named: Path | None = None) -> None:
        if name in self.loras:
            return
        pending = self._unloads.get(name)
        if (
            pending is not None
        ):  # the same name unloading there: let that finish first (bounded by its timeout)
            await asyncio.wait({pending})
        there = self.remote_path(path, named)
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": there}, loaded_ok=True)
        self.loras[name] = there

    def unload_lora(self, name: str) -> None:
        """Unload `name` there in the background (it is no longer routed to at once); failures are logged, and
        UNLOAD_FAILURES in a row take the engine out."""
        if self.loras.pop(name, None) is None or name in self._unloads:
            return
        task = asyncio.get_running_loop().create_task(self._unload(name))
        self._unloads[name] = task
        task.add_done_callback(lambda _: self._unloads.pop(name, None))

    async def _unload(self, name: str) -> None:
        try:
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except (httpx.HTTPError, OSError) as error:
            self.unload_failures += 1
            log.warning("inference engine %s could not unload %s: %s", self.base_url, name, error)
            if self.unload_failures >= UNLOAD_FAILURES:
                self.take_out(f"failed {self.unload_failures} unloads in a row")
        else:
            self.unload_failures = 0

    def revive(self, served: Callable[[], dict[str, Path]]) -> None:
        """In the background, load every version `served()` names again (it may have restarted and lost them);
        routed to again once it holds them all. One revival at a time."""
        if self.healthy or (self._reviving is not None and not self._reviving.done()):
            return
        self._reviving = asyncio.get_running_loop().create_task(self._revive(served))

    async def _revive(self, served: Callable[[], dict[str, Path]]) -> None:
        self.loras.clear()
        try:
            for _ in range(3):  # a version published meanwhile is loaded on the next round
                wanted = served()
                missing = {n: p for n, p in wanted.items() if n not in self.loras}
                if not missing:
                    for name in [n for n in self.loras if n not in wanted]:  # unloaded here meanwhile
                        self.unload_lora(name)
                    self.unload_failures = 0
                    self.healthy = True
                    log.warning(
                        "inference engine %s loaded the versions served again: routed to", self.base_url
                    )
                    return
                for name, path in missing.items():
                    await self.load_lora(name, path)
        except (httpx.HTTPError, OSError) as error:
            log.warning("inference engine %s is still out (%s)", self.base_url, error)

    async def _post(self, path: str, body: dict[str, Any], *, loaded_ok: bool = False) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
            response = await client.post(f"{self.root_url}{path}", json=body, headers=headers)
        if response.status_code >= 400:
            if loaded_ok and response.status_code == 400 and _ALREADY_LOADED.search(response.text):
                return  # it kept the version (it did not restart): as good as loaded
            raise httpx.HTTPStatusError(
                f"{self.root_url}{path} answered {response.status_code}: {response.text[:300]}",
                request=response.request,
                response=response,
            )


_ALREADY_LOADED = re.compile(r"already been loaded|already loaded", re.IGNORECASE)


async def load_on_peers(
    peers: list[PeerEngine],
    name: str,
    path: Path,
    named: Path | None = None,
    served: Callable[[], dict[str, Path]] | None = None,
) -> None:
    """Load a version on every healthy peer; a peer that cannot is taken out of routing (and says why). A peer
    out of routing is asked, in the background, to load the versions `served()` names again."""
    for peer in peers:
        if not peer.healthy:
            if served is not None:
                peer.revive(served)
            continue
        try:
            await peer.load_lora(name, path, named)
        except (httpx.HTTPError, OSError) as error:
            peer.take_out(f"could not load {name} ({error})")


async def unload_on_peers(peers: list[PeerEngine], name: str) -> None:
    """Unload a version on every peer, in the background: this never waits on a peer."""
    for peer in peers:
        peer.unload_lora(name)
