"""Ready-made recording clients: openai and httpx clients whose transport records into the current capture scope.

`openai_client` / `async_openai_client` use the HTTP library openai itself is built on (`httpx2` for openai >= 3,
else `httpx`), so recording adds no HTTP-stack difference; `http_client` / `async_http_client` return `httpx`
clients unless `httpx_module=httpx2` is passed (both work with `ChatOpenAI(http_client=, http_async_client=)`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import httpx
import openai

from .agent_adapters import AgentRouting
from .capture.transport import AsyncRecordingTransport, RecordingTransport

# Generous pool: 256+ concurrent rollouts against one endpoint must not queue on connections.
POOL = {"max_connections": 2048, "max_keepalive_connections": 512, "keepalive_expiry": 30.0}
TIMEOUT = {"timeout": 600.0, "connect": 10.0}


def native_httpx() -> ModuleType:
    """The HTTP library openai is built on: httpx2 (openai >= 3) or httpx."""
    try:
        import httpx2
        from openai import _base_client

        if getattr(_base_client, "httpx2", None) is httpx2:
            return httpx2
    except ImportError:  # pragma: no cover
        pass
    return httpx


def http_client(
    *,
    request_token_ids: bool = False,
    annotate_choices: bool = False,
    logprobs_mode: str | None = None,
    routing: AgentRouting | None = None,
    transport: Any | None = None,
    httpx_module: ModuleType = httpx,
    **client_kw: Any,
) -> httpx.Client:
    """An httpx.Client that records (e.g. `ChatOpenAI(http_client=http_client(), http_async_client=...)`)."""
    hx = httpx_module
    limits = client_kw.pop("limits", None) or hx.Limits(**POOL)
    inner = transport if transport is not None else hx.HTTPTransport(limits=limits)
    client_kw.setdefault("timeout", hx.Timeout(**TIMEOUT))
    client_kw.setdefault("follow_redirects", True)
    recording = RecordingTransport(
        inner,
        request_token_ids=request_token_ids,
        annotate_choices=annotate_choices,
        logprobs_mode=logprobs_mode,
        routing=routing,
    )
    return hx.Client(transport=recording, **client_kw)


_sync_http_client = http_client


def async_http_client(
    *,
    request_token_ids: bool = False,
    annotate_choices: bool = False,
    logprobs_mode: str | None = None,
    routing: AgentRouting | None = None,
    transport: Any | None = None,
    httpx_module: ModuleType = httpx,
    **client_kw: Any,
) -> httpx.AsyncClient:
    """An httpx.AsyncClient that records into the current capture scope."""
    hx = httpx_module
    limits = client_kw.pop("limits", None) or hx.Limits(**POOL)
    inner = transport if transport is not None else hx.AsyncHTTPTransport(limits=limits)
    client_kw.setdefault("timeout", hx.Timeout(**TIMEOUT))
    client_kw.setdefault("follow_redirects", True)
    recording = AsyncRecordingTransport(
        inner,
        request_token_ids=request_token_ids,
        annotate_choices=annotate_choices,
        logprobs_mode=logprobs_mode,
        routing=routing,
    )
    return hx.AsyncClient(transport=recording, **client_kw)


def async_openai_client(
    base_url: str | None = None,
    api_key: str | None = None,
    *,
    request_token_ids: bool = False,
    annotate_choices: bool = False,
    logprobs_mode: str | None = None,
    routing: AgentRouting | None = None,
    http_client: httpx.AsyncClient | None = None,
    **kw: Any,
) -> openai.AsyncOpenAI:
    """An AsyncOpenAI client whose calls inside `capture()` are recorded (extra kw go to AsyncOpenAI)."""
    client = http_client or async_http_client(
        request_token_ids=request_token_ids,
        annotate_choices=annotate_choices,
        logprobs_mode=logprobs_mode,
        routing=routing,
        httpx_module=native_httpx(),
    )
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=client, **kw)  # type: ignore[arg-type]


def openai_client(
    base_url: str | None = None,
    api_key: str | None = None,
    *,
    request_token_ids: bool = False,
    annotate_choices: bool = False,
    logprobs_mode: str | None = None,
    routing: AgentRouting | None = None,
    http_client: httpx.Client | None = None,
    **kw: Any,
) -> openai.OpenAI:
    """A sync OpenAI client whose calls inside `capture()` are recorded."""
    client = http_client or _sync_http_client(
        request_token_ids=request_token_ids,
        annotate_choices=annotate_choices,
        logprobs_mode=logprobs_mode,
        routing=routing,
        httpx_module=native_httpx(),
    )
    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=client, **kw)  # type: ignore[arg-type]
