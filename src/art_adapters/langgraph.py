"""`art_adapters.langgraph` (ART's `art.langgraph`): `wrap_rollout` and `init_chat_model` for LangGraph agents."""

from .adapters.langgraph import init_chat_model, scope, wrap_rollout

__all__ = ["init_chat_model", "scope", "wrap_rollout"]
