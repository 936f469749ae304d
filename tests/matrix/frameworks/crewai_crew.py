"""CrewAI: one `Agent` with a tool in a `Crew`, on CrewAI's own `LLM` (its OpenAI-compatible provider)."""

from __future__ import annotations

import os

from common import ANSWER, Endpoint, call, called, question, tool_names, turns

NAME = "CrewAI"
PACKAGES = ["crewai"]
ENV = "crewai"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"


def script(body: dict) -> str:
    if "get_weather" in tool_names(body):  # native function calling
        return ANSWER if called(body, "get_weather") else call("get_weather", {"city": "Oslo"})
    if any("Observation" in m["content"] for m in turns(body)[1:]):  # CrewAI's ReAct text format
        return f"Thought: I now know the final answer\nFinal Answer: {ANSWER}"
    return 'Thought: Ask the tool.\nAction: get_weather\nAction Input: {"city": "Oslo"}'


async def rollout(endpoint: Endpoint, k: int) -> str:
    os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("OTEL_SDK_DISABLED", "true")
    from crewai import LLM, Agent, Crew, Task
    from crewai.tools import tool

    @tool("get_weather")
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "3C, rain"

    llm = LLM(
        model=f"openai/{endpoint.model}", base_url=endpoint.base_url, api_key=endpoint.api_key, stream=True
    )
    agent = Agent(
        role="Weather reporter", goal="Answer weather questions", backstory="You read the weather tool.",
        llm=llm, tools=[get_weather], verbose=False,
    )  # fmt: skip
    task = Task(description=question(k), expected_output="The weather in one sentence.", agent=agent)
    result = await Crew(agents=[agent], tasks=[task], verbose=False).kickoff_async()
    return str(result.raw)
