"""`art_adapters.openai_agents`: capture OpenAI Agents SDK runs (`Runner.run`) with `wrap_rollout`."""

from .adapters.openai_agents import chat_completions_model, scope, wrap_rollout

__all__ = ["chat_completions_model", "scope", "wrap_rollout"]
