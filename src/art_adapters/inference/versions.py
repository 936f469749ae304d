"""The gateway's table of served versions: which adapter each model name means, which versions the engine holds,
and which of those may leave it. The table changes only under its lock, which is never held while the engine
loads or unloads an adapter (each version has a lock of its own for that), so no request waits on another
version's load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..untrusted import parse_step

KEEP_OLD_S = 30.0  # an old version stays loaded this long after its last use (if the engine has room)


@dataclass
class Version:
    """One immutable adapter: step `step` of a model, served as `adapter` from `path`."""

    step: int
    adapter: str
    path: Path
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    state: str = "absent"  # "absent" | "loading" | "ready" | "unloading"; changed under the table's lock
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while the engine loads or unloads it


@dataclass
class ServedModel:
    """One model's versions on this server; `key` is `{project}/{name}`."""

    key: str
    name: str
    versions: dict[int, Version] = field(default_factory=dict)
    newest: int | None = None


class VersionTable:
    """Models, their versions and the engine's adapters. `load(version)` / `unload(version)` are the engine's
    calls; `capacity()` is how many adapters the engine keeps at once."""

    def __init__(
        self,
        load: Callable[[Version], Awaitable[None]],
        unload: Callable[[Version], Awaitable[None]],
        capacity: Callable[[], int],
        keep_old_s: float = KEEP_OLD_S,
    ) -> None:
        self.models: dict[str, ServedModel] = {}
        self.claims: dict[str, set[str]] = {}  # bare name -> the model keys that use it
        self.keep_old_s = keep_old_s
        self.loads = 0
        self._load, self._unload, self._capacity = load, unload, capacity
        self.lock = asyncio.Lock()

    # ---- names --------------------------------------------------------------------------------------------------

    def resolve(self, requested: str) -> tuple[ServedModel, Version] | str:
        """The model and version a requested name means, or why it is not served (a message naming no others)."""
        base, at, step_text = requested.partition("@")
        model = self.models.get(base)
        if model is None and "/" not in base:
            keys = self.claims.get(base, set())
            if len(keys) > 1:
                return (
                    f"model {base!r} is used by more than one project on this server; "
                    "ask for '{project}/" + base + "'"
                )
            model = self.models.get(next(iter(keys))) if keys else None
        if model is None or model.newest is None:
            return f"model {requested!r} is not served here"
        if not at:
            return model, model.versions[model.newest]
        step = parse_step(step_text)
        if step is None or step not in model.versions:
            return f"model {requested!r} is not served here (no such step)"
        return model, model.versions[step]

    def adapter_name(self, key: str, step: int | None = None) -> str:
        """The adapter serving `key` at `step` (None: its newest version)."""
        model = self.models[key]
        at = model.newest if step is None else step
        if at is None or at not in model.versions:
            raise KeyError(f"{key}@{step} is not served")
        return model.versions[at].adapter

    def names(self) -> list[str]:
        names = [key for key, model in self.models.items() if model.newest is not None]
        names += [name for name, keys in self.claims.items() if len(keys) == 1 and name not in self.models]
        return sorted(names)

    # ---- versions -----------------------------------------------------------------------------------------------

    async def publish(self, key: str, name: str, step: int, path: Path) -> tuple[Version, bool]:
        """Load step `step` of `key` and point the model's names at it; returns the version and whether its bare
        name is now shared by several projects."""
        async with self.lock:
            model = self.models.setdefault(key, ServedModel(key=key, name=name))
            version = model.versions.get(step)
            if version is None or version.path != Path(path):
                version = model.versions[step] = Version(step=step, adapter=f"{key}@{step}", path=Path(path))
            version.in_flight += 1  # pinned while it loads
        try:
            await self.ensure_loaded(version)
        finally:
            async with self.lock:
                version.in_flight -= 1
        async with self.lock:
            if model.newest is None or step >= model.newest:
                model.newest = step
            self.claims.setdefault(name, set()).add(key)
            shared = len(self.claims[name]) > 1
        await self.retire()
        return version, shared

    async def moved(self, key: str, step: int, path: Path) -> None:
        """Version `step` of `key` now lives at `path` (its weights unchanged): loaded again from there."""
        async with self.lock:
            model = self.models.get(key)
            if model is not None and step in model.versions:
                model.versions[step].path = Path(path)

    async def forget(self, key: str, steps: list[int] | None) -> list[Version]:
        """Stop serving `steps` of `key` (None: the whole model); returns the versions to unload once idle."""
        async with self.lock:
            model = self.models.get(key)
            if model is None:
                return []
            gone = [
                model.versions.pop(s)
                for s in (list(model.versions) if steps is None else steps)
                if s in model.versions
            ]
            if steps is None or model.newest not in model.versions:
                model.newest = max(model.versions, default=None)
            if steps is None:
                del self.models[key]
                claims = self.claims.get(model.name, set())
                claims.discard(key)
                if not claims:
                    self.claims.pop(model.name, None)
            return gone

    async def ensure_loaded(self, version: Version) -> None:
        """Have the engine hold `version` (a pinned one: `in_flight` > 0), waiting only on its own load."""
        if version.state == "ready":
            return
        async with version.lock:
            if version.state == "ready":
                return
            async with self.lock:
                version.state = "loading"
            try:
                await self._make_room()
                await self._load(version)
                self.loads += 1
            except BaseException:
                version.state = "absent"
                raise
            version.state = "ready"

    async def unload_if_idle(self, version: Version, *, forgotten: bool = False, wait: bool = True) -> bool:
        """Unload `version` unless a request uses it (or it is its model's newest, unless `forgotten`). `wait=False`:
        leave it if its lock is held (it is loading or unloading), so making room never waits on another load."""
        if not wait and version.lock.locked():
            return False
        async with version.lock:
            async with self.lock:
                if version.state != "ready" or version.in_flight > 0:
                    return False
                if not forgotten and self._is_newest(version):
                    return False
                version.state = "unloading"
            try:
                await self._unload(version)
            finally:
                version.state = "absent"
            return True

    async def retire(self, now: float | None = None) -> None:
        """Unload old versions nobody used for `keep_old_s`, and the least recently used beyond the engine's room."""
        now = time.monotonic() if now is None else now
        for version in self._idle_old(now, room=0):
            await self.unload_if_idle(version, wait=False)

    async def _make_room(self) -> None:
        for version in self._idle_old(time.monotonic(), room=1):
            await self.unload_if_idle(version, wait=False)

    def _idle_old(self, now: float, room: int) -> list[Version]:
        """Idle loaded versions that are not their model's newest and should leave: past their grace, or the least
        recently used of those beyond the engine's capacity less `room`."""
        loaded = [v for m in self.models.values() for v in m.versions.values() if v.state == "ready"]
        old = sorted(
            (v for v in loaded if v.in_flight == 0 and not self._is_newest(v)), key=lambda v: v.last_used
        )
        over = max(len(loaded) + room - max(self._capacity(), 1), 0)
        return [v for i, v in enumerate(old) if i < over or now - v.last_used > self.keep_old_s]

    def _is_newest(self, version: Version) -> bool:
        model = self.models.get(version.adapter.rpartition("@")[0])
        return model is not None and model.newest is not None and model.versions.get(model.newest) is version

    def pin(self, version: Version) -> None:
        """A request starts on `version` (call under the lock)."""
        version.in_flight += 1
        version.last_used = time.monotonic()

    def unpin(self, version: Version) -> None:
        version.in_flight -= 1
        version.last_used = time.monotonic()
