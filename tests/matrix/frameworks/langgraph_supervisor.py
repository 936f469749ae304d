"""A LangGraph supervisor (`langgraph-supervisor`) over a named `create_agent` worker with a tool."""

from __future__ import annotations

from common import ANSWER, Endpoint, call, called, get_weather, question, react, tool_names

NAME = "LangGraph supervisor (named agents)"
PACKAGES = ["langgraph-supervisor", "langgraph"]
ENV = "main"
CALLS = 4  # per rollout
SEQUENCES = 2  # per rollout, after chaining
WHY = "one per agent: the worker's first call starts its own"
STREAMED = "every call"
# the per-agent run: PerAgent(by, agents), each listed agent its own adapter
# (the supervisor reports no agent name: it stays on the shared adapter)
PER_AGENT = ("agent", ["weather_expert"])
HANDOFF = "transfer_to_weather_expert"


def script(body: dict) -> str:
    if HANDOFF in tool_names(body):
        return ANSWER if called(body, HANDOFF) else call(HANDOFF)
    return react(body)


async def rollout(endpoint: Endpoint, k: int) -> str:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from langgraph_supervisor import create_supervisor

    llm = ChatOpenAI(
        model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, streaming=True
    )
    worker = create_agent(
        llm, tools=[get_weather], name="weather_expert", system_prompt="Answer weather questions."
    )
    supervisor = create_supervisor(
        [worker], model=llm, prompt="Send weather questions to weather_expert."
    ).compile()
    state = await supervisor.ainvoke({"messages": [{"role": "user", "content": question(k)}]})
    return state["messages"][-1].content
