"""The OpenAI Agents SDK on its chat-completions model (`OpenAIChatCompletionsModel`), one agent with a tool."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "OpenAI Agents SDK (chat model)"
PACKAGES = ["openai-agents"]
ENV = "main"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call (run_streamed)"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
PER_AGENT = ("agent", ["weather"])
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model=endpoint.model, openai_client=client)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions.",
        model=model,
        tools=[function_tool(get_weather)],
    )
    result = Runner.run_streamed(agent, question(k))
    async for _ in result.stream_events():
        pass
    return result.final_output
