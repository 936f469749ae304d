"""AutoGen AgentChat: an `AssistantAgent` with a tool on `OpenAIChatCompletionClient`, streaming, reflecting on
the tool's result with a second call."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "AutoGen AgentChat"
PACKAGES = ["autogen-agentchat", "autogen-ext"]
ENV = "autogen"
CALLS = 2  # per rollout
SEQUENCES = 2  # per rollout, after chaining
WHY = "tools: the reflection call is sent without the tools"
STREAMED = "every call"
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    info = {
        "vision": False,
        "function_calling": True,
        "json_output": False,
        "family": "unknown",
        "structured_output": False,
    }
    client = OpenAIChatCompletionClient(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, model_info=info
    )
    agent = AssistantAgent(
        "weather",
        model_client=client,
        tools=[get_weather],
        reflect_on_tool_use=True,
        model_client_stream=True,
    )
    result = await agent.run(task=question(k))
    return str(result.messages[-1].content)
