"""An ordinary two-node LangGraph (it knows nothing of art-adapters): a planner writes a plan, an executor answers."""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph


class State(TypedDict, total=False):
    question: str
    plan: str
    answer: str


def build_graph(base_url: str, api_key: str, model_name: str, max_tokens: int = 64) -> Any:
    """planner -> executor. Both nodes use the same model; only the graph tells their calls apart."""
    llm = ChatOpenAI(
        base_url=base_url,
        api_key=api_key,
        model=model_name,
        temperature=1.0,
        max_tokens=max_tokens,
        max_retries=1,
    )

    async def planner(state: State) -> State:
        prompt = [
            {"role": "system", "content": "Write a one-line plan to compute the answer. Do not answer."},
            {"role": "user", "content": state["question"]},
        ]
        return {"plan": str((await llm.ainvoke(prompt)).content)}

    async def executor(state: State) -> State:
        prompt = [
            {"role": "system", "content": "Follow the plan. Reply with the number only."},
            {"role": "user", "content": f"{state['question']}\nPlan: {state['plan']}"},
        ]
        return {"answer": str((await llm.ainvoke(prompt)).content)}

    graph = StateGraph(State)
    graph.add_node("planner", planner)
    graph.add_node("executor", executor)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "executor")
    graph.add_edge("executor", END)
    return graph.compile()
