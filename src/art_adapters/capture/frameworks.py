"""Reads a call's `CallSource` from the agent framework's own context, in the task that sends the request.

* LangChain / LangGraph: LangChain's configure hook (`register_configure_hook`, its documented way to add a
  handler to every callback manager made while a context variable is set) adds an inline handler inside capture
  scopes only. Its `on_chat_model_start` sees the chat model's run id, parent run, tags and metadata (LangGraph's
  `langgraph_node` / `checkpoint_ns`, the user's `role`) in the same task that then sends the HTTP request.
  A client called directly inside a node still gets the node from the runnable config in context.
* OpenAI Agents SDK: its tracing scope (a context variable, set even when tracing is disabled) holds the current
  span; agent spans name the agent, function spans the tool an inner agent runs under.
Only modules the process already imported are consulted: an agent that does not use a framework pays nothing.
"""

from __future__ import annotations

import sys
import weakref
from contextvars import ContextVar
from typing import Any
from uuid import UUID, uuid4

from ..sources import CallSource, current_role

_PENDING: ContextVar[CallSource | None] = ContextVar("art_adapters_chat_model_run", default=None)
_HANDLER: ContextVar[Any] = ContextVar("art_adapters_langchain_handler", default=None)
_registered = False
_LOCAL_TRACE_IDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# Model runs started and not yet ended. A stream abandoned mid-way ends (LangChain reports an error when the
# generator is closed) in whichever task closes it, so the starting task's pending source is checked here.
_LIVE_RUNS: set[str] = set()


def source_of_context() -> CallSource:
    """The source of a call being sent from this context (framework context, then the user's role)."""
    source = _langchain_source() or _agents_source() or CallSource()
    role = current_role()
    if role is not None:
        source = source.model_copy(update={"role": role})
    return source


# ---- LangChain / LangGraph ---------------------------------------------------------------------------------------


def enable_langchain_sources() -> Any:
    """Inside a capture scope: make LangChain's callback managers carry our inline handler. Returns the token to
    `disable_langchain_sources` with (None when LangChain is not imported)."""
    if "langchain_core" not in sys.modules:
        return None
    handler = _handler()
    if handler is None:
        return None
    return _HANDLER.set(handler)


def disable_langchain_sources(token: Any) -> None:
    if token is not None:
        _HANDLER.reset(token)


def _handler() -> Any:
    global _registered
    try:
        from langchain_core.tracers.context import register_configure_hook
    except ImportError:  # pragma: no cover - a langchain_core without the hook
        return None
    if not _registered:
        register_configure_hook(_HANDLER, True)
        _registered = True
    return _source_handler()


_INSTANCE: list[Any] = []


def _source_handler() -> Any:
    """One stateless handler: it only writes the run's source into the calling task's context."""
    if _INSTANCE:
        return _INSTANCE[0]
    from langchain_core.callbacks import BaseCallbackHandler

    class SourceHandler(BaseCallbackHandler):
        run_inline = True  # called in the task that makes the request, so the context variable reaches it
        # only model runs matter: every other event is skipped at the dispatcher's first check
        ignore_chain = ignore_agent = ignore_retriever = ignore_retry = ignore_custom_event = True

        def on_chat_model_start(
            self,
            serialized: dict[str, Any],
            messages: Any,
            *,
            run_id: UUID,
            parent_run_id: UUID | None = None,
            tags: list[str] | None = None,
            metadata: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            _LIVE_RUNS.add(str(run_id))
            _PENDING.set(_from_metadata(metadata or {}, tags or [], run_id, parent_run_id))

        def on_llm_start(self, *args: Any, run_id: UUID, **kwargs: Any) -> None:
            self.on_chat_model_start({}, None, run_id=run_id, **kwargs)

        def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
            _clear(run_id)

        def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
            _clear(run_id)

    _INSTANCE.append(SourceHandler())
    return _INSTANCE[0]


def _clear(run_id: UUID) -> None:
    _LIVE_RUNS.discard(str(run_id))
    pending = _PENDING.get()
    if pending is not None and pending.run_id == str(run_id):
        _PENDING.set(None)


def _from_metadata(
    metadata: dict[str, Any], tags: list[str], run_id: UUID | None, parent_run_id: UUID | None
) -> CallSource:
    node = metadata.get("langgraph_node")
    namespace = metadata.get("checkpoint_ns", metadata.get("langgraph_checkpoint_ns"))
    role = metadata.get("role")
    # LangChain v1's create_agent(name=...) names its runs: supervisors' and swarms' workers
    agent = metadata.get("lc_agent_name")
    return CallSource(
        framework="langgraph" if node is not None else "langchain",
        agent=agent if isinstance(agent, str) and agent else None,
        node=str(node) if node is not None else None,
        checkpoint_ns=str(namespace) if namespace else None,
        run_id=str(run_id) if run_id is not None else None,
        parent_run_id=str(parent_run_id) if parent_run_id is not None else None,
        role=role if isinstance(role, str) and role else None,
        tags=[t for t in tags if isinstance(t, str) and not t.startswith(("graph:step:", "seq:step:"))],
    )


def _langchain_source() -> CallSource | None:
    pending = _PENDING.get()
    if pending is not None and pending.run_id in _LIVE_RUNS:
        return pending
    if "langchain_core" not in sys.modules:
        return None
    from langchain_core.runnables.config import var_child_runnable_config

    config = var_child_runnable_config.get()
    if not config:
        return None
    metadata = config.get("metadata") or {}
    if "langgraph_node" not in metadata and "role" not in metadata:
        return None
    callbacks = config.get("callbacks")
    parent = getattr(callbacks, "parent_run_id", None)
    return _from_metadata(metadata, list(config.get("tags") or []), None, parent)


# ---- OpenAI Agents SDK -------------------------------------------------------------------------------------------


def _agents_source() -> CallSource | None:
    if "agents.tracing.scope" not in sys.modules:
        return None
    from agents.tracing.scope import Scope

    trace_id = _trace_id(Scope.get_current_trace())
    span = Scope.get_current_span()
    if span is None:
        return None
    path: list[str] = []
    model_span_id: str | None = None
    agent_span_id: str | None = None
    for depth, current in enumerate(_span_chain(span)):
        data = getattr(current, "span_data", None)
        kind = getattr(data, "type", None)
        if depth == 0 and kind in ("response", "generation"):
            model_span_id = _real_id(current)
        elif kind == "agent":
            path.append(str(data.name))  # type: ignore[union-attr]
            if agent_span_id is None:
                agent_span_id = _real_id(current)
        elif kind == "function" and path:
            path.append(f"tool:{data.name}")  # type: ignore[union-attr]
    agents = [name for name in reversed(path) if not name.startswith("tool:")]
    if not agents:
        return None
    return CallSource(
        framework="openai_agents",
        agent=agents[-1],
        agent_path=agents,
        trace_id=trace_id,
        run_id=model_span_id,
        parent_run_id=agent_span_id,
    )


def _span_chain(span: Any) -> list[Any]:
    """The current span and the spans it was started under, innermost first. A span remembers the one it
    replaced as current through the context-variable token it holds (`Token.old_value`)."""
    chain = []
    seen: set[int] = set()
    while span is not None and id(span) not in seen and len(chain) < 64:
        chain.append(span)
        seen.add(id(span))
        token = getattr(span, "_prev_span_token", None)
        previous = getattr(token, "old_value", None)
        span = None if previous is None or previous is getattr(token, "MISSING", object()) else previous
    return chain


def _trace_id(trace: Any) -> str | None:
    """The trace's id; with tracing disabled (every run's trace is a fresh no-op object, id "no-op") a local id
    kept for as long as that object lives, so two runs are still told apart."""
    if trace is None:
        return None
    real = getattr(trace, "trace_id", None)
    if real and real != "no-op":
        return str(real)
    try:
        return _LOCAL_TRACE_IDS.setdefault(trace, f"local_{uuid4().hex}")
    except TypeError:  # an object that cannot be weakly referenced
        return None


def _real_id(span: Any) -> str | None:
    value = getattr(span, "span_id", None)
    return str(value) if value and value != "no-op" else None


def with_handoffs(source: CallSource, earlier: list[CallSource]) -> CallSource:
    """An Agents SDK call's source with `handoffs`: the agents that held the same run (same trace, same enclosing
    agents) before its agent, in order, from the calls captured earlier in the trajectory."""
    if source.framework != "openai_agents" or source.agent is None:
        return source
    outer = source.agent_path[:-1]
    chain: list[str] = []
    for other in earlier:
        if other.framework != "openai_agents" or other.agent_path[:-1] != outer or other.agent is None:
            continue
        if other.trace_id != source.trace_id:
            continue
        if not chain or chain[-1] != other.agent:
            chain.append(other.agent)
    if chain and chain[-1] == source.agent:
        chain.pop()
    return source.model_copy(update={"handoffs": chain}) if chain else source
