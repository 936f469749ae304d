"""A plain OpenAI tool agent, captured with `art_adapters.openai.wrap_rollout`: the SQLite env, or any MCP server.

python examples/openai_tool_agent.py --endpoint http://127.0.0.1:8000/v1                         # SQLite env
python examples/openai_tool_agent.py --endpoint URL --mcp "python examples/mcp_server.py"        # MCP tools
"""

from __future__ import annotations

import argparse
import asyncio
import json

import openai

import art_adapters as art
from art_adapters.envs import MCPServerSpec, Scenario, SQLiteEnv, ToolSet, exact_match_reward, mcp_toolset
from art_adapters.openai import run_tool_loop, wrap_rollout

NOTES_SCENARIOS = [
    Scenario(id="notes-0", question="What is the capital of Peru? Look it up in the notes.", answer="Lima"),
    Scenario(id="notes-1", question="What is 19.5 plus 22.5? Use the add tool.", answer=42),
]


async def run(
    args: argparse.Namespace, tools: ToolSet, scenarios: list[Scenario], system: str, reward
) -> list[art.Trajectory]:
    model = art.Model(name=args.model_name, inference_base_url=args.endpoint, inference_api_key=args.api_key)

    @wrap_rollout(model)
    async def rollout(scenario: Scenario) -> float:
        client = openai.AsyncOpenAI(base_url=args.endpoint, api_key=args.api_key)  # the agent's own client
        messages = [{"role": "system", "content": system}, {"role": "user", "content": scenario.question}]
        result = await run_tool_loop(
            client, args.model_name, messages, functions=tools, max_turns=args.max_turns
        )
        return reward(scenario, result.final)

    return list(await asyncio.gather(*(rollout(s) for s in scenarios for _ in range(args.group_size))))


async def main(argv: list[str] | None = None) -> list[art.Trajectory]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model-name", default="tool-agent")
    parser.add_argument(
        "--mcp", help="an MCP server: a command line (stdio) or an http(s) URL (streamable HTTP)"
    )
    parser.add_argument("--db", default=None)
    parser.add_argument("--scenarios", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=6)
    args = parser.parse_args(argv)

    if args.mcp:
        async with mcp_toolset(MCPServerSpec.parse(args.mcp)) as tools:
            system = "Use the tools. Reply with the final answer only."
            trajectories = await run(
                args, tools, NOTES_SCENARIOS[: args.scenarios], system, exact_match_reward
            )
    else:
        env = SQLiteEnv(args.db)
        trajectories = await run(
            args, env.tools(), env.scenarios("val", n=args.scenarios), env.system_prompt(), env.reward
        )
    for t in trajectories:
        print(json.dumps({"reward": t.reward, "llm_calls": len(t.llm_calls), "messages": len(t.messages())}))
    return trajectories


if __name__ == "__main__":
    asyncio.run(main())
