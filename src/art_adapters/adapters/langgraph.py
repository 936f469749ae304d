"""LangGraph / LangChain adapter (ART's `art.langgraph`): `wrap_rollout` and `init_chat_model`.

Any LangGraph agent (`create_agent`, `create_react_agent`, a hand-built `StateGraph`, subgraphs, checkpointers,
`ainvoke`/`astream`) whose `ChatOpenAI` talks to the model's endpoint is captured with no change but
`@wrap_rollout(model)`: see `adapters.base` for how the scope reaches clients the agent built itself. The caller's
RunnableConfig and callbacks are never touched; nothing is captured outside the decorated call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..recording import async_http_client, http_client
from .base import current_route, route_for, scope, wrap_rollout

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

    from ..model import Model

__all__ = ["init_chat_model", "scope", "wrap_rollout"]


def init_chat_model(
    model: Model | str | None = None,
    *,
    request_token_ids: bool | None = None,
    model_provider: str | None = None,
    configurable_fields: None = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> ChatOpenAI:
    """A `ChatOpenAI` bound to the model's endpoint and recording http clients (sync and async).

    `model`: an art Model, or None for the model of the enclosing `wrap_rollout` (ART's usage: called inside the
    rollout), or a served-model name to use with that rollout's endpoint. Other keyword arguments go to
    `ChatOpenAI` (default `temperature=1.0`, `stream_usage=True`); its calls record only inside a capture scope.
    LangChain's `model_provider` (only "openai": the endpoint speaks OpenAI's API), `configurable_fields` and
    `config_prefix` are accepted as ART accepts them.
    """
    from langchain_openai import ChatOpenAI

    if model_provider not in (None, "openai") or configurable_fields is not None:
        raise ValueError(
            "init_chat_model: the model's endpoint is OpenAI-compatible; model_provider must be None or 'openai' "
            "and configurable_fields None"
        )

    route = current_route()
    name: str | None = model if isinstance(model, str) else None
    bound: Model | None = None if isinstance(model, str) or model is None else model
    if bound is None:
        bound = route.model if route is not None else None
    if bound is None:
        raise RuntimeError(
            "init_chat_model() needs a model: pass one, or call it inside a wrap_rollout(model) rollout"
        )
    if bound.inference_base_url is None:
        raise RuntimeError(
            f"model {bound.name!r} has no inference endpoint: register it or set inference_base_url"
        )
    if request_token_ids is None:
        request_token_ids = (
            route.request_token_ids
            if route is not None and route.model is bound
            else route_for(bound).request_token_ids
        )
    mode = (
        route.logprobs_mode if route is not None and route.model is bound else route_for(bound).logprobs_mode
    )
    routing = route_for(bound).routing  # per-agent adapters: each call goes to its agent's adapter
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("stream_usage", True)
    return ChatOpenAI(
        model=name or bound.get_inference_name(),
        base_url=bound.inference_base_url,
        api_key=bound.inference_api_key or "none",
        http_client=http_client(request_token_ids=request_token_ids, logprobs_mode=mode, routing=routing),
        http_async_client=async_http_client(
            request_token_ids=request_token_ids, logprobs_mode=mode, routing=routing
        ),
        **kwargs,
    )
