"""A LangGraph swarm (`langgraph-swarm`): a triage agent hands off to a named weather agent with a tool."""

from __future__ import annotations

from common import Endpoint, call, get_weather, question, react, tool_names

NAME = "LangGraph swarm (handoffs)"
PACKAGES = ["langgraph-swarm", "langgraph"]
ENV = "main"
CALLS = 3  # per rollout
SEQUENCES = 2  # per rollout, after chaining
WHY = "one per agent: the handoff starts the expert's own"
STREAMED = "every call"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
PER_AGENT = ("agent", ["triage", "weather_expert"])
HANDOFF = "transfer_to_weather_expert"


def script(body: dict) -> str:
    return call(HANDOFF) if HANDOFF in tool_names(body) else react(body)


async def rollout(endpoint: Endpoint, k: int) -> str:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from langgraph_swarm import create_handoff_tool, create_swarm

    llm = ChatOpenAI(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, streaming=True
    )
    triage = create_agent(llm, tools=[create_handoff_tool(agent_name="weather_expert")], name="triage")
    expert = create_agent(
        llm, tools=[get_weather], name="weather_expert", system_prompt="Answer weather questions."
    )
    swarm = create_swarm([triage, expert], default_active_agent="triage").compile()
    state = await swarm.ainvoke({"messages": [{"role": "user", "content": question(k)}]})
    return state["messages"][-1].content
