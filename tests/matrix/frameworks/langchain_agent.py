"""LangChain v1's `create_agent` on `ChatOpenAI`, streamed (`astream`), as LangChain's docs show it."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "LangChain v1 create_agent"
PACKAGES = ["langchain", "langchain-openai"]
ENV = "main"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
# (an agent without a name reports only its node)
PER_AGENT = ("node", ["model"])
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, streaming=True
    )
    agent = create_agent(llm, tools=[get_weather], system_prompt="You answer weather questions.")
    state = await agent.ainvoke({"messages": [{"role": "user", "content": question(k)}]})
    return state["messages"][-1].content
