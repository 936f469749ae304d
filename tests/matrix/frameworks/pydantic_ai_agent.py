"""pydantic-ai: an `Agent` on `OpenAIChatModel` with a plain tool, run streamed (`run_stream`)."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "pydantic-ai"
PACKAGES = ["pydantic-ai-slim"]
ENV = "frameworks"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=endpoint.base_url, api_key=endpoint.api_key)
    agent = Agent(OpenAIChatModel(endpoint.model, provider=provider), tools=[get_weather])
    async with agent.run_stream(question(k)) as result:
        return await result.get_output()
