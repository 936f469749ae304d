"""The LangGraph adapter against ScriptedServer: every call of an unchanged agent recorded in order, nothing outside."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.callbacks import AsyncCallbackHandler  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.adapters.base import hook_installed  # noqa: E402
from art_adapters.capture import capture  # noqa: E402
from art_adapters.langgraph import init_chat_model, wrap_rollout  # noqa: E402
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOL_THEN_ANSWER = [
    Reply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
    Reply(content="The sum is 5."),
]


def model_for(server: ScriptedServer) -> art.Model:
    return art.Model(name="agent", inference_base_url=server.base_url, inference_api_key="x")


def chat(server: ScriptedServer, **kw: Any) -> ChatOpenAI:
    """What an existing agent builds itself: a plain ChatOpenAI on the endpoint, no http clients of ours."""
    return ChatOpenAI(base_url=server.base_url, api_key="x", model="agent", max_retries=0, **kw)


def assert_token_ids(trajectory: art.Trajectory) -> None:
    for call in trajectory.llm_calls:
        assert call.prompt_token_ids == token_ids(
            prompt_text(call.request["messages"], call.request.get("tools"))
        )
        assert call.completion_token_ids, "completion token ids recorded"


def roles(trajectory: art.Trajectory) -> list[str]:
    return [m["role"] for m in trajectory.messages()]


def hand_built_graph(llm: ChatOpenAI, tools: list[Any], checkpointer: Any = None) -> Any:
    bound = llm.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


async def test_create_agent_every_call_in_order_with_token_ids() -> None:
    from langchain.agents import create_agent

    with ScriptedServer(TOOL_THEN_ANSWER) as server:
        model = model_for(server)
        agent = create_agent(
            model=chat(server), tools=[add], system_prompt="You add."
        )  # built before decorating

        @wrap_rollout(model, request_token_ids=True)
        async def rollout(question: str) -> float:
            result = await agent.ainvoke({"messages": [{"role": "user", "content": question}]})
            return 1.0 if "5" in result["messages"][-1].content else 0.0

        trajectory = await rollout("2 + 3?")
    assert trajectory.reward == 1.0
    assert len(trajectory.llm_calls) == 2 and not trajectory.additional_histories
    assert roles(trajectory) == ["system", "user", "assistant", "tool", "assistant"]
    tool_message = trajectory.messages()[3]
    assert tool_message["content"] == "5" and tool_message["tool_call_id"] == "call_0"
    assert trajectory.llm_calls[1].request["messages"][-1]["content"] == "5"
    assert [t["function"]["name"] for t in trajectory.tools or []] == ["add"]
    assert_token_ids(trajectory)
    assert not hook_installed()


async def test_create_react_agent_and_art_style_trajectory() -> None:
    from langgraph.prebuilt import create_react_agent

    with ScriptedServer(TOOL_THEN_ANSWER) as server:
        model = model_for(server)

        async def rollout(question: str) -> art.Trajectory:
            agent = create_react_agent(init_chat_model(), [add])  # ART's usage: init_chat_model() inside
            await agent.ainvoke({"messages": [HumanMessage(question)]})
            return art.Trajectory(reward=0.5, metadata={"q": question})

        trajectory = await wrap_rollout(model, rollout, request_token_ids=True)("2 + 3?")
    assert trajectory.reward == 0.5 and trajectory.metadata == {"q": "2 + 3?"}
    assert roles(trajectory) == ["user", "assistant", "tool", "assistant"]
    assert len(trajectory.llm_calls) == 2
    assert_token_ids(trajectory)


async def test_hand_built_graph_parallel_tool_calls() -> None:
    script = [
        Reply(
            tool_calls=[
                {"name": "add", "arguments": {"a": 2, "b": 3}},
                {"name": "multiply", "arguments": {"a": 4, "b": 5}},
            ]
        ),
        Reply(content="5 and 20"),
    ]
    with ScriptedServer(script) as server:

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout() -> float:
            graph = hand_built_graph(chat(server), [add, multiply])
            await graph.ainvoke({"messages": [HumanMessage("2+3 and 4*5?")]})
            return 1.0

        trajectory = await rollout()
    messages = trajectory.messages()
    assert roles(trajectory) == ["user", "assistant", "tool", "tool", "assistant"]
    assert len(messages[1]["tool_calls"]) == 2
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:4]] == [("call_0", "5"), ("call_1", "20")]
    assert_token_ids(trajectory)


async def test_subgraph_calls_are_recorded() -> None:
    with ScriptedServer(TOOL_THEN_ANSWER) as server:
        inner = hand_built_graph(chat(server), [add])
        outer = StateGraph(MessagesState)
        outer.add_node("research", inner)  # a compiled graph as a node
        outer.add_edge(START, "research")
        outer.add_edge("research", END)
        graph = outer.compile()

        @wrap_rollout(model_for(server))
        async def rollout() -> None:
            await graph.ainvoke({"messages": [HumanMessage("2+3?")]})

        trajectory = await rollout()
    assert trajectory.reward == 0.0 and len(trajectory.llm_calls) == 2
    assert roles(trajectory) == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("mode", ["messages", "updates"])
async def test_astream_modes(mode: str) -> None:
    with ScriptedServer(TOOL_THEN_ANSWER) as server:
        graph = hand_built_graph(chat(server), [add])

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout() -> float:
            events = [e async for e in graph.astream({"messages": [HumanMessage("2+3?")]}, stream_mode=mode)]
            return float(len(events))

        trajectory = await rollout()
    assert trajectory.reward > 0
    assert len(trajectory.llm_calls) == 2
    assert all(call.error is None for call in trajectory.llm_calls)
    assert roles(trajectory) == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages()[-1]["content"] == "The sum is 5."
    if mode == "messages":  # streamed: the SSE answer is reassembled, ids per delta
        assert all(call.stream for call in trajectory.llm_calls)
    assert_token_ids(trajectory)


class Recorder(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.tags: list[list[str]] = []

    async def on_chat_model_start(self, serialized: Any, messages: Any, **kw: Any) -> None:
        self.events.append("llm_start")
        self.tags.append(kw.get("tags") or [])

    async def on_llm_end(self, response: Any, **kw: Any) -> None:
        self.events.append("llm_end")

    async def on_tool_end(self, output: Any, **kw: Any) -> None:
        self.events.append("tool_end")


async def test_checkpointer_thread_config_and_callbacks_pass_through() -> None:
    script = [*TOOL_THEN_ANSWER, Reply(content="You asked about 2 + 3.")]
    with ScriptedServer(script) as server:
        graph = hand_built_graph(chat(server), [add], checkpointer=InMemorySaver())
        recorder = Recorder()
        config = {"configurable": {"thread_id": "t-1"}, "callbacks": [recorder], "tags": ["mine"]}

        @wrap_rollout(model_for(server))
        async def rollout() -> float:
            await graph.ainvoke({"messages": [HumanMessage("2+3?")]}, config)
            state = await graph.ainvoke({"messages": [HumanMessage("What did I ask?")]}, config)
            return float(len(state["messages"]))

        before = json.dumps({k: v for k, v in config.items() if k != "callbacks"})
        trajectory = await rollout()
    assert trajectory.reward == 6.0
    assert (
        config["callbacks"] == [recorder]
        and json.dumps({k: v for k, v in config.items() if k != "callbacks"}) == before
    )
    assert recorder.events == [
        "llm_start",
        "llm_end",
        "tool_end",
        "llm_start",
        "llm_end",
        "llm_start",
        "llm_end",
    ]
    assert all("mine" in tags for tags in recorder.tags)
    assert len(trajectory.llm_calls) == 3 and not trajectory.additional_histories  # turn 2 extends turn 1
    assert roles(trajectory) == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    snapshot = await graph.aget_state(config)
    assert len(snapshot.values["messages"]) == 6


class Answer(BaseModel):
    value: int
    reason: str


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_with_structured_output(method: str) -> None:
    payload = {"value": 5, "reason": "2 + 3"}
    reply = (
        Reply(content=json.dumps(payload))
        if method == "json_schema"
        else Reply(tool_calls=[{"name": "Answer", "arguments": payload}])
    )
    with ScriptedServer([reply]) as server:

        @wrap_rollout(model_for(server), request_token_ids=True)
        async def rollout() -> float:
            structured = chat(server).with_structured_output(Answer, method=method)
            answer = await structured.ainvoke([HumanMessage("2+3?")])
            assert isinstance(answer, Answer)
            return float(answer.value)

        trajectory = await rollout()
    assert trajectory.reward == 5.0 and len(trajectory.llm_calls) == 1
    request = trajectory.llm_calls[0].request
    assert ("response_format" in request) == (method == "json_schema")
    assert_token_ids(trajectory)


async def test_summariser_lands_in_additional_histories() -> None:
    script = [*TOOL_THEN_ANSWER, Reply(content="User wanted a sum; it is 5.")]
    with ScriptedServer(script) as server:
        llm = chat(server)
        agent = hand_built_graph(llm, [add])

        async def summarise(state: MessagesState) -> dict[str, Any]:
            transcript = "\n".join(f"{m.type}: {m.content}" for m in state["messages"])
            summary = await llm.ainvoke(
                [SystemMessage("Summarise the conversation."), HumanMessage(transcript)]
            )
            return {"messages": [summary]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", agent)
        graph.add_node("summarise", summarise)
        graph.add_edge(START, "agent")
        graph.add_edge("agent", "summarise")
        graph.add_edge("summarise", END)
        compiled = graph.compile()

        @wrap_rollout(model_for(server))
        async def rollout() -> float:
            await compiled.ainvoke({"messages": [HumanMessage("2+3?")]})
            return 1.0

        trajectory = await rollout()
    assert len(trajectory.llm_calls) == 3
    histories = [trajectory.messages(), *(h.messages() for h in trajectory.additional_histories)]
    assert len(histories) == 2
    agent_history = next(h for h in histories if any(m["role"] == "tool" for m in h))
    summary_history = next(h for h in histories if h[0].get("content") == "Summarise the conversation.")
    assert [m["role"] for m in agent_history] == ["user", "assistant", "tool", "assistant"]
    assert [m["role"] for m in summary_history] == ["system", "user", "assistant"]
    assert sum(len(h.llm_calls) for h in trajectory.additional_histories) == 1


def by_question(request: dict[str, Any]) -> Reply:
    question = next(m["content"] for m in request["messages"] if m["role"] == "user")
    if request["messages"][-1]["role"] == "tool":
        return Reply(content=f"done {question}")
    return Reply(tool_calls=[{"name": "add", "arguments": {"a": len(question), "b": 1}}])


async def test_concurrent_decorated_and_undecorated_calls_do_not_mix() -> None:
    with ScriptedServer(by_question) as server:
        graph = hand_built_graph(chat(server), [add])
        model = model_for(server)

        @wrap_rollout(model)
        async def rollout(question: str) -> float:
            await asyncio.sleep(0)
            await graph.ainvoke({"messages": [HumanMessage(question)]})
            return 1.0

        async def undecorated(question: str) -> None:
            await graph.ainvoke({"messages": [HumanMessage(question)]})

        questions = [f"q{i}" * (i + 1) for i in range(12)]
        results = await asyncio.gather(
            *(rollout(q) for q in questions), *(undecorated(f"plain{i}") for i in range(6))
        )
        outside = await rollout.__wrapped__("not a rollout")  # the bare function records nothing anywhere
    assert outside == 1.0
    trajectories = results[: len(questions)]
    for question, trajectory in zip(questions, trajectories, strict=True):
        assert len(trajectory.llm_calls) == 2
        for call in trajectory.llm_calls:
            assert call.request["messages"][0]["content"] == question
        assert trajectory.messages()[-1]["content"] == f"done {question}"
    assert len(server.requests) == 2 * (len(questions) + 6 + 1)
    assert not hook_installed()


async def test_nothing_captured_outside_and_sync_invoke_inside() -> None:
    with ScriptedServer(lambda request: Reply(content="ok")) as server:
        llm = chat(server)
        with capture() as outside:  # a bare capture scope: a plain ChatOpenAI is not a recording client
            await llm.ainvoke("outside")
        assert outside.llm_calls == []

        @wrap_rollout(model_for(server))
        def sync_rollout() -> float:
            return 1.0 if llm.invoke("inside, sync").content == "ok" else 0.0

        trajectory = sync_rollout()
        await llm.ainvoke("after")
    assert trajectory.reward == 1.0 and len(trajectory.llm_calls) == 1
    assert trajectory.llm_calls[0].request["messages"][0]["content"] == "inside, sync"
    assert len(server.requests) == 3


async def test_init_chat_model_records_inside_capture_only() -> None:
    with ScriptedServer(lambda request: Reply(content="ok")) as server:
        model = model_for(server)
        llm = init_chat_model(model, request_token_ids=True)
        assert llm.model_name == "agent" and llm.temperature == 1.0
        await llm.ainvoke("not recorded")
        async with capture() as trajectory:
            await llm.ainvoke("recorded")
            llm.invoke("recorded too")
        with pytest.raises(RuntimeError, match="needs a model"):
            init_chat_model()
    assert [c.request["messages"][0]["content"] for c in trajectory.llm_calls] == ["recorded", "recorded too"]
    assert_token_ids(trajectory)


async def test_an_endpoint_other_than_the_models_is_not_recorded() -> None:
    with (
        ScriptedServer(lambda r: Reply(content="a")) as ours,
        ScriptedServer(lambda r: Reply(content="b")) as judge,
    ):

        @wrap_rollout(model_for(ours))
        async def rollout() -> float:
            await chat(ours).ainvoke("mine")
            await chat(judge).ainvoke("a judge on another endpoint")
            return 1.0

        trajectory = await rollout()
    assert [c.request["messages"][0]["content"] for c in trajectory.llm_calls] == ["mine"]
