"""Scoped capture for the adapters: inside a decorated rollout only, the model's endpoint calls of ANY httpx client
(openai's, LangChain's, the Agents SDK's, built before or inside the call) go through `capture`'s recording transport.

How, and why this way:

* An agent's own `ChatOpenAI(base_url=...)` / `openai.AsyncOpenAI(base_url=...)` builds httpx2 (openai 3.x) or httpx
  clients we never see, often at import time, and LangChain caches them per base_url process-wide (`lru_cache`).
  Hooking client *construction* would therefore miss module-level agents and leak recording clients into later,
  undecorated code; we hook the one place every request passes instead: the client's per-URL transport lookup
  (`Client._transport_for_url`, httpx and httpx2, sync and async).
* The hook exists only while at least one decorated call runs (installed on the first scope's entry, removed on
  the last one's exit; nothing at import time) and is inert for everything not inside a scope: it reads a
  ContextVar, and unless this task is inside `wrap_rollout` *and* the URL is a completions URL of the rollout's
  endpoint, it returns the client's own transport untouched. Tasks and threads that copy the context
  (asyncio tasks, `asyncio.to_thread`, LangChain's executors) inherit the scope; other tasks never see it.
* Inside the scope, the request goes through `capture.AsyncRecordingTransport` (the one capture mechanism)
  wrapping the client's own transport (its proxies, TLS, pool); httpx2 requests and responses pass through it
  as they are (`_httpx2` only re-types what it builds), bytes untouched. Clients that already record
  (`init_chat_model`, `model.openai_client()`) are left alone, so nothing is recorded twice.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import httpx

from ..agent_adapters import AgentRouting
from ..calls import endpoint_kind
from ..capture import AsyncRecordingTransport, RecordingTransport, capture
from ..sources import SplitBy
from ..trajectories import Trajectory

if TYPE_CHECKING:
    from ..model import Model

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Which requests of this scope are recorded: completions, Responses and Anthropic Messages POSTs under one of
    `prefixes` (any when empty)."""

    prefixes: tuple[str, ...] = ()
    request_token_ids: bool = False
    model: Model | None = None
    logprobs_mode: str | None = None
    routing: AgentRouting | None = (
        None  # per-agent adapters: each call's model name becomes its agent's adapter
    )

    def matches(self, url: Any) -> bool:
        text = str(url)
        if endpoint_kind(text) is None:
            return False
        return not self.prefixes or any(text.startswith(p) for p in self.prefixes)


ROUTE: ContextVar[Route | None] = ContextVar("art_adapters_route", default=None)


def current_route() -> Route | None:
    return ROUTE.get()


def route_for(
    model: Model | None, request_token_ids: bool | None = None, endpoints: tuple[str, ...] = ()
) -> Route:
    """The route of a rollout of `model`: its endpoint (plus `endpoints`), token ids when its backend gives them."""
    prefixes = list(endpoints)
    if model is not None and model.inference_base_url:
        prefixes.append(model.inference_base_url)
    endpoint = getattr(model, "_endpoint", None) if model is not None else None
    if request_token_ids is None:
        request_token_ids = bool(endpoint is not None and getattr(endpoint, "supports_token_ids", False))
    normalized = tuple(sorted({str(p).rstrip("/") + "/" for p in prefixes}))
    mode = getattr(endpoint, "logprobs_mode", None) if endpoint is not None else None
    routing = getattr(model, "agent_routing", lambda: None)() if model is not None else None
    return Route(
        prefixes=normalized,
        request_token_ids=request_token_ids,
        model=model,
        logprobs_mode=mode,
        routing=routing,
    )


# ---- the scoped transport hook ---------------------------------------------------------------------------------

_lock = threading.Lock()
_depth = 0
_saved: list[tuple[type, Any, Any]] = []


def _targets() -> list[tuple[type, bool, bool]]:
    """(client class, is async, is httpx2) for every httpx flavour that is importable."""
    out: list[tuple[type, bool, bool]] = [(httpx.Client, False, False), (httpx.AsyncClient, True, False)]
    try:
        import httpx2
    except ImportError:
        return out
    return out + [(httpx2.Client, False, True), (httpx2.AsyncClient, True, True)]


def _make_hook(
    original: Callable[[Any, Any], Any], is_async: bool, is_httpx2: bool
) -> Callable[[Any, Any], Any]:
    def _transport_for_url(self: Any, url: Any) -> Any:
        transport = original(self, url)
        route = ROUTE.get()
        if route is None or not route.matches(url) or isinstance(transport, _RECORDING):
            return transport
        return _wrap(transport, route, is_async, is_httpx2)

    _transport_for_url.__art_adapters_hook__ = True  # type: ignore[attr-defined]
    return _transport_for_url


def _install() -> None:
    """Count a scope in and hook each client class (once). A class whose private lookup is gone (a future httpx)
    is skipped with a warning: capture then works through recording clients only, never crashes a rollout."""
    global _depth
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for cls, is_async, is_httpx2 in _targets():
            original = cls.__dict__.get("_transport_for_url")
            if not callable(original):
                _warn_unhookable(cls)
                continue
            hook = _make_hook(original, is_async, is_httpx2)
            cls._transport_for_url = hook  # type: ignore[attr-defined]
            _saved.append((cls, original, hook))


_warned: set[type] = set()


def _warn_unhookable(cls: type) -> None:
    if cls not in _warned:
        _warned.add(cls)
        log.warning(
            "%s.%s has no _transport_for_url: calls of clients the agent builds itself are not captured; "
            "use model.openai_client() or init_chat_model() (recording clients)",
            cls.__module__,
            cls.__qualname__,
        )


def _uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        while _saved:
            cls, original, hook = _saved.pop()
            if cls.__dict__.get("_transport_for_url") is hook:  # someone else re-patched since: leave theirs
                cls._transport_for_url = original  # type: ignore[attr-defined]


def hook_installed() -> bool:
    return _depth > 0


@contextmanager
def scope(
    model: Model | None = None,
    *,
    request_token_ids: bool | None = None,
    endpoints: tuple[str, ...] = (),
    trajectory: Trajectory | None = None,
    main: Literal["first", "last", "most_calls"] = "most_calls",
    split_by: SplitBy | None = None,
) -> Iterator[Trajectory]:
    """A capture scope plus the route: every matching call made in this context is recorded into the Trajectory.

    `main`: which captured conversation becomes the trajectory's own when the rollout built none: the one with
    most calls (default: the agent loop, not a one-shot summariser or judge next to it) or the `last` one.
    `split_by` ("node", "agent", "role"): conversations never mix calls from two of them (see Trajectory.finish).
    """
    route = route_for(model, request_token_ids, endpoints)
    token = ROUTE.set(route)
    try:
        _install()
        with capture(trajectory, split_by=split_by) as current:
            yield current
            rebuild = main != "last" and not current.messages_and_choices and not current.additional_histories
        if rebuild and current.additional_histories:  # capture's finish() chose "last"; choose again
            current.messages_and_choices, current.tools, current.additional_histories = [], None, []
            current.finish(main=main, split_by=split_by)
    finally:
        ROUTE.reset(token)
        _uninstall()


# ---- wrapping a client's transport ---------------------------------------------------------------------------

_RECORDING: tuple[type, ...] = (RecordingTransport, AsyncRecordingTransport)


def _wrap(transport: Any, route: Route, is_async: bool, is_httpx2: bool) -> Any:
    options: dict[str, Any] = {
        "request_token_ids": route.request_token_ids,
        "logprobs_mode": route.logprobs_mode,
        "routing": route.routing,
    }
    if not is_httpx2:
        return (
            AsyncRecordingTransport(transport, **options)
            if is_async
            else RecordingTransport(transport, **options)
        )
    from ._httpx2 import wrap_async, wrap_sync

    return wrap_async(transport, **options) if is_async else wrap_sync(transport, **options)


# ---- the decorator -----------------------------------------------------------------------------------------------


def finalize(captured: Trajectory, result: Any) -> Trajectory:
    """Merge what the rollout returned (a reward, a Trajectory, or None) with what was captured."""
    if isinstance(result, Trajectory):
        if result is not captured:
            if not result.llm_calls:
                result.llm_calls = list(captured.llm_calls)
            if not result.additional_histories:
                result.additional_histories = list(captured.additional_histories)
            if not result.messages_and_choices:
                result.messages_and_choices = list(captured.messages_and_choices)
                result.tools = result.tools if result.tools is not None else captured.tools
            result.logs = [*captured.logs, *result.logs]
            result.start_time = min(result.start_time, captured.start_time)
            result.finish()
        return result
    if isinstance(result, bool) or not (result is None or isinstance(result, int | float)):
        raise TypeError(
            f"a rollout must return a float reward, a Trajectory or None, not {type(result).__name__}"
        )
    if result is not None:
        captured.reward = float(result)
    return captured


@overload
def wrap_rollout(model: Model | None, fn: F, **options: Any) -> Callable[..., Any]: ...
@overload
def wrap_rollout(
    model: Model | None, fn: None = None, **options: Any
) -> Callable[[F], Callable[..., Any]]: ...


def wrap_rollout(model: Model | None = None, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Make a rollout trainable: `wrap_rollout(model, fn)` or `@wrap_rollout(model)`.

    The function runs the agent unchanged and returns a float reward, a Trajectory, or None; the wrapped one
    returns the Trajectory holding every LLM call it made to the model's endpoint, in order (token ids where the
    endpoint gives them). Options: `request_token_ids` (default: whether the model's backend gives them),
    `endpoints` (more base URLs to record), `main` and `split_by` (see `scope`). Sync functions give sync
    wrappers. Each call records where it came from (`call.source`: graph node, agent, role).
    """
    if fn is None:
        return functools.partial(wrap_rollout, model, **options)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Trajectory:
            with scope(model, **options) as trajectory:
                result = await fn(*args, **kwargs)
            return finalize(trajectory, result)

        return async_wrapper

    @functools.wraps(fn)
    def sync_wrapper(*args: Any, **kwargs: Any) -> Trajectory:
        with scope(model, **options) as trajectory:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                raise TypeError("wrap_rollout: the function returned an awaitable; declare it `async def`")
        return finalize(trajectory, result)

    return sync_wrapper
