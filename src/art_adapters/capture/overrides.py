"""A scoped rewrite of the requests a rollout sends through the recording transport: evaluation sampling
(temperature, top_p, max_tokens, a seed per call) and the evaluated model's names mapped to one served target.

It is a context variable, set only around one evaluation attempt (`request_override(...)`): nothing is patched,
and requests outside that context pass untouched. The rollout's code never changes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

_DROP = {"content-encoding", "content-length", "transfer-encoding"}
# where each endpoint keeps its output-length limit
_LIMIT_KEYS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}


def call_seed(base: int, *parts: Any) -> int:
    """A stable 31-bit seed from `base` and `parts` (scenario id, attempt, call index): the same on every target."""
    digest = hashlib.sha256(json.dumps([base, *[str(p) for p in parts]]).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class RequestOverride:
    """What to change in each completions request of one attempt.

    `sampling`: temperature / top_p / max_tokens to set (None values are left as the rollout sent them).
    `seed_parts`: (base seed, scenario id, attempt); call i of the attempt gets `call_seed(*seed_parts, i)`;
    None: seeds are left alone. `model_names`: requested model name -> the name to send instead. `stranded`:
    names whose requests cannot reach the target (a reference elsewhere) unless already sent to `target_url`:
    such a request is refused, with `refused` saying why, rather than answered by the wrong model."""

    sampling: Mapping[str, Any] = field(default_factory=dict)
    seed_parts: tuple[Any, ...] | None = None
    model_names: Mapping[str, str] = field(default_factory=dict)
    stranded: Mapping[str, str] = field(default_factory=dict)  # model name -> why it cannot reach the target
    target_url: str = ""
    unseeded: frozenset[str] = frozenset(
        {"messages"}
    )  # endpoint kinds that take no seed (Anthropic's Messages API)
    calls: int = 0  # requests rewritten so far
    refused: str | None = None  # set when a request was refused

    def rewrite(self, payload: dict[str, Any], kind: str) -> dict[str, Any]:
        """The payload with the overrides applied; counts the call."""
        out = dict(payload)
        index = self.calls
        self.calls += 1
        model = out.get("model")
        if isinstance(model, str) and model in self.model_names:
            out["model"] = self.model_names[model]
        for key in ("temperature", "top_p"):
            if self.sampling.get(key) is not None:
                out[key] = self.sampling[key]
        limit = self.sampling.get("max_tokens")
        if limit is not None:
            keys = _LIMIT_KEYS.get(kind, ("max_tokens",))
            present = [k for k in keys if k in out]
            for k in present or keys[-1:]:
                out[k] = limit
        if self.seed_parts is not None and kind not in self.unseeded:
            out["seed"] = call_seed(*self.seed_parts, index)
        return out


class StrandedRequestError(RuntimeError):
    """A request the evaluated target cannot receive (it would be answered by another model)."""


OVERRIDE: ContextVar[RequestOverride | None] = ContextVar("art_adapters_request_override", default=None)


def current_override() -> RequestOverride | None:
    return OVERRIDE.get()


@contextmanager
def request_override(override: RequestOverride) -> Iterator[RequestOverride]:
    """Apply `override` to the completions requests sent from this context (and tasks it starts)."""
    token = OVERRIDE.set(override)
    try:
        yield override
    finally:
        OVERRIDE.reset(token)


def overridden(request: Any, body: bytes, kind: str, override: RequestOverride) -> tuple[Any, bytes]:
    """`request` (httpx or httpx2) with its JSON body rewritten by `override`; a body that is not a JSON object
    passes unchanged."""
    try:
        payload = json.loads(body)
    except ValueError:
        return request, body
    if not isinstance(payload, dict):
        return request, body
    model = payload.get("model")
    if (
        isinstance(model, str)
        and model in override.stranded
        and not str(request.url).startswith(override.target_url)
    ):
        override.refused = override.stranded[model]
        raise StrandedRequestError(override.refused)
    body = json.dumps(override.rewrite(payload, kind)).encode()
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _DROP]
    headers.append(("content-length", str(len(body))))
    new = type(request)(
        request.method, request.url, headers=headers, content=body, extensions=request.extensions
    )
    return new, body
