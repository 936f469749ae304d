"""OpenAI Agents SDK adapter: `Runner.run` on an `OpenAIChatCompletionsModel` inside `@wrap_rollout(model)` is captured.

The agent's own `AsyncOpenAI(base_url=<the model's endpoint>)` is recorded through the scoped hook of
`adapters.base`; `chat_completions_model()` builds one bound to a recording client explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..recording import async_openai_client
from .base import current_route, route_for, scope, wrap_rollout

if TYPE_CHECKING:
    from agents import OpenAIChatCompletionsModel

    from ..model import Model

__all__ = ["chat_completions_model", "scope", "wrap_rollout"]


def chat_completions_model(
    model: Model | None = None, *, request_token_ids: bool | None = None, **client_kw: Any
) -> OpenAIChatCompletionsModel:
    """An Agents SDK chat-completions model on the art model's endpoint (None: the enclosing rollout's model)."""
    from agents import OpenAIChatCompletionsModel

    route = current_route()
    bound = model if model is not None else (route.model if route is not None else None)
    if bound is None or bound.inference_base_url is None:
        raise RuntimeError(
            "chat_completions_model() needs a model with an endpoint (or a wrap_rollout around it)"
        )
    if request_token_ids is None:
        request_token_ids = route_for(bound).request_token_ids
    client = async_openai_client(
        base_url=bound.inference_base_url,
        api_key=bound.inference_api_key or "none",
        request_token_ids=request_token_ids,
        routing=route_for(bound).routing,  # per-agent adapters: each call goes to its agent's adapter
        **client_kw,
    )
    return OpenAIChatCompletionsModel(model=bound.get_inference_name(), openai_client=client)
