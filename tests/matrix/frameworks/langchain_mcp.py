"""LangGraph users' MCP: `create_agent` with tools that `langchain-mcp-adapters` loads from an MCP server (stdio,
examples/mcp_server.py), in an environment with mcp 1.x (the adapters require mcp < 2; our dev pins 2.x)."""

from __future__ import annotations

import sys
from pathlib import Path

from common import Endpoint, question, react

NAME = "LangGraph + MCP tools (langchain-mcp-adapters)"
PACKAGES = ["langchain-mcp-adapters", "mcp"]
ENV = "mcp1"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
# (an agent without a name reports only its node)
PER_AGENT = ("node", ["model"])
SERVER = Path(__file__).parents[3] / "examples" / "mcp_server.py"


def script(body: dict) -> str:
    return react(body, "read_note", {"key": "capital-of-peru"})


async def rollout(endpoint: Endpoint, k: int) -> str:
    from langchain.agents import create_agent
    from langchain_mcp_adapters.client import MultiServerMCPClient
    from langchain_openai import ChatOpenAI

    client = MultiServerMCPClient(
        {"notes": {"command": sys.executable, "args": [str(SERVER)], "transport": "stdio"}}
    )
    tools = await client.get_tools()
    llm = ChatOpenAI(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, streaming=True
    )
    agent = create_agent(llm, tools=tools, system_prompt="Look things up in the notes.")
    state = await agent.ainvoke({"messages": [{"role": "user", "content": question(k)}]})
    return state["messages"][-1].content
