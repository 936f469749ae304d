"""smolagents: a `ToolCallingAgent` on `OpenAIServerModel`; it ends with its `final_answer`
tool. It re-renders tool calls and observations as text between steps, so each step starts a new sequence."""

from __future__ import annotations

from common import ANSWER, Endpoint, call, called, question, turns

NAME = "smolagents (ToolCallingAgent)"
PACKAGES = ["smolagents"]
ENV = "frameworks"
CALLS = 2  # per rollout
SEQUENCES = 2  # per rollout, after chaining
WHY = "edited: it renders its tool calls and observations back as text"
STREAMED = "every call"


def script(body: dict) -> str:
    history = turns(body)[1:]
    observed = called(body, "get_weather") or any(
        m["role"] == "tool" or "Observation" in m["content"] for m in history
    )
    return call("final_answer", {"answer": ANSWER}) if observed else call("get_weather", {"city": "Oslo"})


async def rollout(endpoint: Endpoint, k: int) -> str:
    import asyncio

    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        return "3C, rain"

    model = OpenAIServerModel(
        model_id=endpoint.model, api_base=endpoint.base_url, api_key=endpoint.api_key, max_tokens=256
    )
    agent = ToolCallingAgent(
        tools=[get_weather], model=model, max_steps=3, stream_outputs=True, verbosity_level=0
    )
    return str(await asyncio.to_thread(agent.run, question(k)))
