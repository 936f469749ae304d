"""Per-agent LoRA adapters (`art.PerAgent`): which adapter each captured call belongs to, the adapters' names, and the
routing that rewrites a request's model name to its agent's served adapter (`{project}/{name}.{adapter}`).

The agent's code never changes: it keeps calling the model's one inference name; capture (in-process and through
the recording endpoint) asks `AgentRouting.rewrite` for the call's `CallSource` and sends the request to the
agent's adapter. A call whose key is None, or not among a fixed `agents` list, stays on the shared adapter.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from .sources import CallSource

RouteBy = Literal["agent", "node", "role"]
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,48}")
SHARED = ""  # the key of the shared (default) adapter in the trainer and the metrics
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_HASHED = re.compile(r".*-[0-9a-f]{8}")  # how a sanitized name ends: a key ending so is hashed too
RESERVED = frozenset({"shared"})  # the shared adapter's name in the metrics (`agent/shared/...`)
# what a step records per adapter, as `agent/{name}/{metric}` (the shared adapter's name there is "shared")
AGENT_METRICS = ("loss", "trained_tokens", "grad_norm", "reward_mean", "trajectories")


def shown(value: object, limit: int = 64) -> str:
    """`repr(value)` cut to about `limit` characters: what an error message may quote of a value it refuses (a
    registration's values come from a client and may be huge; the server never echoes them back whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text)} chars)"


class UnsupportedPerAgentSetting(ValueError):
    """A setting PerAgent cannot honour yet (RemoteBackend, modules_to_save, Unsloth, ...), refused
    before anything loads."""


def adapter_name(key: str) -> str:
    """The adapter name of an agent key: the key itself when it is 1-48 of [A-Za-z0-9_-], is not "shared" and does
    not end like a sanitized name ("-" and 8 lowercase hex); otherwise a stable sanitized name: runs of other
    characters become "_", cut to 32, then "-" and 8 hex of the key's blake2b ("Research Agent" ->
    "Research_Agent-<hash>"). A key kept as it is never ends like a sanitized name, so two keys never share a name
    (unless their hashes collide), and a run resumes to the same names. Never "." (a PEFT adapter and a served
    name both forbid it there)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"an agent key is a non-empty string, not {shown(key)}")
    if is_adapter_name(key) and not _HASHED.fullmatch(key):
        return key
    stem = _UNSAFE.sub("_", key).strip("_")[:32] or "agent"
    return f"{stem}-{hashlib.blake2b(key.encode(), digest_size=4).hexdigest()}"


class PerAgent(BaseModel):
    """Give every agent its own LoRA adapter on the shared base: `TrainableModel(..., adapters=art.PerAgent())`.

    `by`: what names a call's agent: "agent" (the framework's agent name: Agents SDK agents, `create_agent(name=)`),
    "node" (the LangGraph node path, so two subgraphs' same-named nodes are two agents), "role" (`art.role(...)`,
    else the agent, else the node path), or a function of the call's `CallSource` returning a key or None.
    `agents`: a fixed list of keys (each gets an adapter at registration; any other key uses the shared adapter);
    None: every key seen gets an adapter, a key first seen mid-run a fresh one (logged) once it has trained.
    A call whose key is None always uses the shared adapter, which is the model's own (`{project}/{name}`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    by: RouteBy | Callable[[CallSource], str | None] = "agent"
    agents: list[str] | None = Field(default=None)

    @field_validator("by", mode="before")
    @classmethod
    def _check_by(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("agent", "node", "role"):
            raise ValueError(f"PerAgent(by=...) is 'agent', 'node', 'role' or a function, not {shown(value)}")
        if not isinstance(value, str) and not callable(value):
            raise ValueError(f"PerAgent(by=...) is 'agent', 'node', 'role' or a function, not {shown(value)}")
        return value

    @model_validator(mode="after")
    def _check_agents(self) -> PerAgent:
        if self.agents is None:
            return self
        if not self.agents:
            raise ValueError("PerAgent(agents=[]) lists no agent: give at least one, or None for every agent")
        names: dict[str, str] = {}
        for key in self.agents:
            name = adapter_name(key)
            if name in names:
                raise ValueError(
                    f"PerAgent(agents=...): {shown(key)} and {shown(names[name])} name the same adapter"
                )
            names[name] = key
        return self

    @field_serializer("by")
    def _show_by(self, value: Any) -> str:
        return (
            value if isinstance(value, str) else f"<function {getattr(value, '__qualname__', repr(value))}>"
        )

    def key_of(self, source: CallSource | None) -> str | None:
        """The call's agent key (before the `agents` list applies), or None."""
        if source is None:
            return None
        if isinstance(self.by, str):
            key = source.node_path if self.by == "node" else source.key(self.by)
        else:
            key = self.by(source)
            if key is not None and not isinstance(key, str):
                raise TypeError(f"PerAgent(by={self._show_by(self.by)}) returned {shown(key)}; a str or None")
        return key or None

    def adapter_of(self, source: CallSource | None) -> str:
        """The adapter a call from `source` trains and is served by: its agent's adapter name, or SHARED ("")."""
        key = self.key_of(source)
        if key is None or (self.agents is not None and key not in self.agents):
            return SHARED
        return adapter_name(key)

    def listed(self) -> list[str]:
        """The adapter names of a fixed `agents` list (empty when agents=None)."""
        return [adapter_name(key) for key in self.agents or []]


def served_name(model_key: str, adapter: str) -> str:
    """The served name of an adapter of the model served as `model_key` (`{project}/{name}`)."""
    return model_key if adapter == SHARED else f"{model_key}.{adapter}"


def is_adapter_name(adapter: object) -> bool:
    """Whether `adapter` is a valid adapter name: 1-48 of [A-Za-z0-9_-], not a reserved one ("shared")."""
    return (
        isinstance(adapter, str) and ADAPTER_NAME.fullmatch(adapter) is not None and adapter not in RESERVED
    )


def check_adapter_name(adapter: str) -> str:
    """`adapter` if it is a valid adapter name (what a folder or a served name may be built from); else a
    ValueError naming it. Names come from `adapter_name`; a name read from a request or a disk is checked here."""
    if not is_adapter_name(adapter):
        raise ValueError(f"{shown(adapter)} is not an adapter name (1-48 of [A-Za-z0-9_-], not 'shared')")
    return adapter


def served_adapter(served_model: str | None, model_key: str | None = None) -> tuple[str, int | None] | None:
    """Which adapter (SHARED for the shared one) and version a call's `served_model` (`{project}/{name}.{adapter}@
    {step}`) names; None when there is none. With `model_key` (`{project}/{name}`) the split is exact; without
    it the part after the last "." of the name is the adapter (a model whose own name holds a "." then reads as
    an agent's: docs/multi-agent.md, "Name collision")."""
    if not served_model:
        return None
    base, at, step = served_model.partition("@")
    version = int(step) if at and step.isascii() and step.isdigit() else None
    if model_key is not None:
        if base == model_key:
            return SHARED, version
        head, dot, adapter = base.partition(model_key + ".")
        return (adapter, version) if not head and dot and ADAPTER_NAME.fullmatch(adapter) else None
    name = base.rpartition("/")[2]
    stem, dot, adapter = name.rpartition(".")
    return (adapter, version) if dot and stem and ADAPTER_NAME.fullmatch(adapter) else (SHARED, version)


class AgentRouting:
    """What capture asks per call: the model's names, its PerAgent rule and the adapters the backend serves now
    (an agent not yet served stays on the shared adapter until its first trained version is published)."""

    def __init__(self, per_agent: PerAgent, model_key: str, bare_name: str) -> None:
        self.per_agent = per_agent
        self.model_key = model_key
        self.bare_name = bare_name
        self._served: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    @property
    def served(self) -> frozenset[str]:
        return self._served

    def set_served(self, adapters: Iterable[str]) -> None:
        with self._lock:
            self._served = frozenset(a for a in adapters if a != SHARED)

    def rewrite(self, requested: Any, source: CallSource | None) -> str | None:
        """The model name a request for `requested` made from `source` goes to, or None to leave it as sent: only
        the model's own names (`{project}/{name}` or `{name}`, with or without `@step`) are routed."""
        if not isinstance(requested, str):
            return None
        base, at, step = requested.partition("@")
        if base not in (self.model_key, self.bare_name):
            return None
        adapter = self.per_agent.adapter_of(source)
        if adapter == SHARED or adapter not in self._served:
            return None
        return served_name(self.model_key, adapter) + (f"@{step}" if at else "")
