"""Our own MCP toolset (`art_adapters.envs.mcp_toolset`) under `run_tool_loop`, at the low end of the `mcp` range
the `mcp` extra declares (1.10; the dev environment tests 2.x)."""

from __future__ import annotations

import sys
from pathlib import Path

from common import Endpoint, question, react

NAME = "art_adapters MCP toolset + run_tool_loop (mcp 1.10)"
PACKAGES = ["mcp", "pydantic"]
ENV = "mcp110"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "none"
SERVER = Path(__file__).parents[3] / "examples" / "mcp_server.py"


def script(body: dict) -> str:
    return react(body, "read_note", {"key": "capital-of-peru"})


async def rollout(endpoint: Endpoint, k: int) -> str:
    import openai

    from art_adapters.envs import MCPServerSpec, mcp_toolset
    from art_adapters.openai import run_tool_loop

    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    async with mcp_toolset(MCPServerSpec.stdio(sys.executable, str(SERVER))) as tools:
        messages = [{"role": "user", "content": question(k)}]
        result = await run_tool_loop(client, endpoint.model, messages, tools.schemas, tools, max_turns=3)
    assert result.tool_calls == 1 and result.tool_errors == 0, result.messages
    assert result.messages[2]["content"] == "Lima", result.messages
    return result.final or ""
