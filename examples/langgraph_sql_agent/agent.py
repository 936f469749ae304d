"""An ordinary LangGraph SQL agent (it knows nothing of art-adapters): a ChatOpenAI with query tools in a loop."""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from art_adapters.envs import SQLiteEnv


def build_agent(
    base_url: str, api_key: str, model_name: str, env: SQLiteEnv, temperature: float = 1.0
) -> Any:
    """The compiled graph: agent -> tools -> agent ... until the model answers without a tool call."""

    @tool
    async def run_query(sql: str) -> str:
        """Run one read-only SQLite query on the shop database and return the rows."""
        return await env.db.aquery(sql)

    @tool
    def describe_schema() -> str:
        """The CREATE TABLE statements of the shop database."""
        return env.db.schema()

    tools = [run_query, describe_schema]
    llm = ChatOpenAI(
        base_url=base_url, api_key=api_key, model=model_name, temperature=temperature, max_retries=1
    )
    bound = llm.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()
