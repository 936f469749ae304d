"""The OpenAI Agents SDK on its default Responses model: a triage agent hands off to a weather agent with a tool."""

from __future__ import annotations

from common import Endpoint, call, get_weather, question, react, tool_names

NAME = "OpenAI Agents SDK (Responses model, handoff)"
PACKAGES = ["openai-agents"]
ENV = "main"
CALLS = 3  # per rollout
SEQUENCES = 2  # per rollout, after chaining
WHY = "one per agent: the handoff starts the weather agent's own"
STREAMED = "every call (run_streamed)"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
PER_AGENT = ("agent", ["triage", "weather"])


def script(body: dict) -> str:
    if "transfer_to_weather" in tool_names(body):
        return call("transfer_to_weather")
    return react(body)


async def rollout(endpoint: Endpoint, k: int) -> str:
    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    model = OpenAIResponsesModel(model=endpoint.model, openai_client=client)
    weather = Agent(
        name="weather",
        instructions="Answer weather questions.",
        model=model,
        tools=[function_tool(get_weather)],
    )
    triage = Agent(
        name="triage", instructions="Hand weather questions to weather.", model=model, handoffs=[weather]
    )
    result = Runner.run_streamed(triage, question(k))
    async for _ in result.stream_events():
        pass
    return result.final_output
