"""deepagents: `create_deep_agent` with a weather sub-agent; the main agent starts two sub-agents in parallel (two
`task` calls in one turn), each calls the tool and answers, then the main agent answers."""

from __future__ import annotations

from common import ANSWER, Endpoint, call, called, get_weather, question, react, tool_names

NAME = "deepagents (parallel sub-agents)"
PACKAGES = ["deepagents"]
ENV = "main"
CALLS = 6  # per rollout: main, 2 x (sub-agent tool, sub-agent answer), main
SEQUENCES = 3  # per rollout, after chaining
WHY = "one per agent: the main agent's and each sub-agent's"
STREAMED = "every call"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
# (the main agent reports only its node: it stays on the shared adapter)
PER_AGENT = ("agent", ["weather"])
UNMARKED = 4  # per rollout: the sub-agents' calls see only their task, not the rollout's question


def script(body: dict) -> str:
    if "task" not in tool_names(body):
        return react(body)
    if called(body, "task"):
        return ANSWER
    tasks = [  # (short texts: the longer a steered text, the likelier the engine picks other tokens for it)
        call("task", {"description": f"The weather in {city}.", "subagent_type": "weather"})
        for city in ("Oslo", "Bergen")
    ]
    return "\n".join(tasks)


async def rollout(endpoint: Endpoint, k: int) -> str:
    from deepagents import create_deep_agent
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, streaming=True
    )
    weather = {
        "name": "weather",
        "description": "Finds the weather in one city.",
        "system_prompt": "Use get_weather, then answer.",
        "tools": [get_weather],
    }
    agent = create_deep_agent(
        model=llm, tools=[], system_prompt="Delegate weather questions.", subagents=[weather]
    )
    state = await agent.ainvoke({"messages": [{"role": "user", "content": question(k)}]})
    return state["messages"][-1].content
