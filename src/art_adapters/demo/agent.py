"""The demo's agent: an ordinary LangGraph support agent (a StateGraph with a ToolNode and ChatOpenAI) whose tools
answer from a SQLite database of orders. It imports nothing from art-adapters: `art-adapters demo` trains it as is.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from langchain_core.messages import SystemMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

SYSTEM = "You are a shop's support agent. Answer the question about an order with one tool call."


def order_tools(db_path: str | Path) -> list[BaseTool]:
    """Four lookups of one order each. One-word names: each is a single token of the demo's tiny model, so choosing
    a tool is one sampled token (a real model needs no such care)."""
    uri = f"{Path(db_path).resolve().as_uri()}?mode=ro"  # read-only: the agent can look, never change

    def lookup(sql: str, order_id: int) -> str:
        db = sqlite3.connect(uri, uri=True)
        try:
            rows = db.execute(sql, (order_id,)).fetchall()
        finally:
            db.close()
        return ", ".join(str(value) for row in rows for value in row) or f"no order {order_id}"

    @tool
    def day(order_id: int) -> str:
        """The date an order was placed."""
        return lookup("SELECT order_date FROM orders WHERE id = ?", order_id)

    @tool
    def name(order_id: int) -> str:
        """The customer who placed an order."""
        return lookup(
            "SELECT c.name FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.id = ?", order_id
        )

    @tool
    def object(order_id: int) -> str:
        """The products in an order."""
        return lookup(
            "SELECT p.name FROM order_items i JOIN products p ON p.id = i.product_id WHERE i.order_id = ? "
            "ORDER BY p.id",
            order_id,
        )

    @tool
    def result(order_id: int) -> str:
        """The status of an order: delivered, shipped or cancelled."""
        return lookup("SELECT status FROM orders WHERE id = ?", order_id)

    return [day, name, object, result]


def build_agent(
    base_url: str, model: str, db_path: str | Path, *, api_key: str = "none", seed: int | None = None
) -> Any:
    """The compiled graph: agent -> tools -> agent ... until the model answers without a tool call.

    `seed` makes the sampling repeatable (the demo's runs repeat); leave it out for your own agent.
    """
    tools = order_tools(db_path)
    llm = ChatOpenAI(
        base_url=base_url,
        api_key=api_key,  # type: ignore[arg-type]
        model=model,
        temperature=1.0,
        max_tokens=48,  # type: ignore[call-arg]
        seed=seed,
        max_retries=1,
    ).bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()
