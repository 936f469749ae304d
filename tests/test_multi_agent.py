"""Named agents from third-party multi-agent libraries (`langgraph-supervisor`, `langgraph-swarm`), wrapped as their
docs show: every call is captured once, and each agent's calls chain into one conversation although `ChatOpenAI`
echoes every answer back under the agent's `name` (which the engine's answer does not carry)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

import art_adapters as art
from art_adapters.langgraph import wrap_rollout
from art_adapters.testing import Reply, ScriptedServer

aio = pytest.mark.asyncio


@tool
def web_search(query: str) -> str:
    """Search the web."""
    return "Paris has 2.1M people"


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


SUPERVISOR_SCRIPT = [
    Reply(tool_calls=[{"name": "transfer_to_research_expert", "arguments": {}}]),
    Reply(tool_calls=[{"name": "web_search", "arguments": {"query": "paris population"}}]),
    Reply(content="Paris has 2.1M people."),
    Reply(tool_calls=[{"name": "transfer_to_math_expert", "arguments": {}}]),
    Reply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
    Reply(content="2 + 3 = 5."),
    Reply(content="All done: 2.1M and 5."),
]


def workers(llm: ChatOpenAI) -> list[Any]:
    return [
        create_agent(llm, tools=[web_search], name="research_expert", system_prompt="You research."),
        create_agent(llm, tools=[add], name="math_expert", system_prompt="You do math."),
    ]


@aio
async def test_a_supervisor_with_two_named_workers_gives_one_history_per_agent() -> None:
    from langgraph_supervisor import create_supervisor

    with ScriptedServer(SUPERVISOR_SCRIPT) as server:
        llm = ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_retries=0)
        supervisor = create_supervisor(workers(llm), model=llm, prompt="You manage experts.").compile()
        model = art.Model(name="m", project="p", inference_base_url=server.base_url, inference_api_key="x")

        @wrap_rollout(model)
        async def rollout() -> None:
            await supervisor.ainvoke(
                {"messages": [{"role": "user", "content": "Population of Paris, and 2+3?"}]}
            )

        trajectory = await rollout()
    assert len(trajectory.llm_calls) == len(server.requests) == 7
    echoed = [m for c in trajectory.llm_calls for m in c.request_messages() if m.get("name")]
    assert {m["name"] for m in echoed} == {"supervisor", "research_expert", "math_expert"}
    # the supervisor's three calls are one conversation (the main one: it holds the final answer), each worker's
    # two calls another; not seven one-call fragments
    assert 1 + len(trajectory.additional_histories) == 3
    assert trajectory.messages()[-1]["content"] == "All done: 2.1M and 5."
    assert sorted(len(h.llm_calls) for h in trajectory.additional_histories) == [2, 2]
    # create_agent(name=...) names each worker's calls; the supervisor (langgraph.prebuilt) names none
    assert [c.source.agent for c in trajectory.llm_calls].count(None) == 3
    assert {c.source.agent for c in trajectory.llm_calls} == {"research_expert", "math_expert", None}
    by_node = trajectory.histories(by="node")
    assert {key: [len(h.llm_calls) for h in hs] for key, hs in by_node.items()} == {
        "supervisor/agent": [3],
        "research_expert/model": [2],
        "math_expert/model": [2],
    }


@aio
async def test_a_swarm_of_named_agents_hands_off_within_one_history_per_agent() -> None:
    from langgraph_swarm import create_handoff_tool, create_swarm

    script = [
        Reply(tool_calls=[{"name": "transfer_to_math_expert", "arguments": {}}]),
        Reply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
        Reply(content="2 + 3 = 5."),
    ]
    with ScriptedServer(script) as server:
        llm = ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_retries=0)
        triage = create_agent(
            llm,
            tools=[create_handoff_tool(agent_name="math_expert")],
            name="triage",
            system_prompt="You route.",
        )
        math = create_agent(llm, tools=[add], name="math_expert", system_prompt="You do math.")
        swarm = create_swarm([triage, math], default_active_agent="triage").compile()
        model = art.Model(name="m", project="p", inference_base_url=server.base_url, inference_api_key="x")

        @wrap_rollout(model, split_by="node")
        async def rollout() -> None:
            await swarm.ainvoke({"messages": [{"role": "user", "content": "2+3?"}]})

        trajectory = await rollout()
    assert len(trajectory.llm_calls) == len(server.requests) == 3
    by_node = trajectory.histories(by="node")
    assert {key: [len(h.llm_calls) for h in hs] for key, hs in by_node.items()} == {
        "triage/model": [1],
        "math_expert/model": [2],
    }
