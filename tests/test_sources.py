"""Where each call came from (`LLMCall.source`), read from the frameworks' own context: LangGraph nodes (hand-built
graph, subgraph, parallel `Send`, `create_agent`), Agents SDK agents (handoffs, agents-as-tools, on the default
Responses model, JSON and streamed), `art.role`; and the Responses API capture itself. Real SDKs against the
scripted OpenAI-compatible server (deterministic tool calls)."""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

import art_adapters as art
from art_adapters.capture import AsyncRecordingTransport
from art_adapters.langgraph import wrap_rollout
from art_adapters.openai_agents import wrap_rollout as agents_rollout
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.training.samples import excluded_reason

set_tracing_disabled(True)
aio = pytest.mark.asyncio


class State(TypedDict):
    task: str
    notes: Annotated[list[str], operator.add]


def art_model(server: ScriptedServer) -> art.Model:
    return art.Model(name="m", project="p", inference_base_url=server.base_url, inference_api_key="x")


def planner_graph(server: ScriptedServer) -> Any:
    """planner -> two parallel `Send`s to executor -> a `review` subgraph (its node `critic`)."""
    llm = ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_retries=0)

    async def planner(state: State) -> dict[str, Any]:
        answer = await llm.ainvoke(f"Plan: {state['task']}")
        return {"notes": [str(answer.content)]}

    async def executor(state: State) -> dict[str, Any]:
        answer = await llm.with_config(metadata={"role": "worker"}).ainvoke(f"Do: {state['task']}")
        return {"notes": [str(answer.content)]}

    async def critic(state: State) -> dict[str, Any]:
        answer = await llm.ainvoke(f"Review: {state['notes']}")
        return {"notes": [str(answer.content)]}

    review = StateGraph(State)
    review.add_node("critic", critic)
    review.add_edge(START, "critic")
    review.add_edge("critic", END)
    graph = StateGraph(State)
    graph.add_node("planner", planner)
    graph.add_node("executor", executor)
    graph.add_node("review", review.compile())
    graph.add_edge(START, "planner")
    graph.add_conditional_edges(
        "planner",
        lambda s: [Send("executor", {"task": f"part {i}", "notes": []}) for i in range(2)],
        ["executor"],
    )
    graph.add_edge("executor", "review")
    graph.add_edge("review", END)
    return graph.compile()


@aio
async def test_langgraph_nodes_subgraph_and_send_are_told_apart() -> None:
    with ScriptedServer(lambda request: Reply(content="ok")) as server:
        graph = planner_graph(server)

        @wrap_rollout(art_model(server), split_by="node")
        async def rollout() -> float:
            await graph.ainvoke({"task": "t", "notes": []})
            return 1.0

        trajectory = await rollout()
    sources = [c.source for c in trajectory.llm_calls]
    assert [s.node_path for s in sources] == ["planner", "executor", "executor", "review/critic"]
    assert {s.framework for s in sources} == {"langgraph"}
    assert [s.role for s in sources] == [None, "worker", "worker", None]
    executors = sources[1:3]  # parallel Send branches: one node, two runs, two namespaces
    assert (
        executors[0].run_id != executors[1].run_id
        and executors[0].checkpoint_ns != executors[1].checkpoint_ns
    )
    assert all(s.run_id and s.parent_run_id for s in sources)
    assert sources[3].checkpoint_ns and sources[3].checkpoint_ns.startswith("review:")
    by_node = trajectory.histories(by="node")
    assert {k: sum(len(h.llm_calls) for h in v) for k, v in by_node.items()} == {
        "planner": 1,
        "executor": 2,
        "review/critic": 1,
    }
    assert set(trajectory.histories(by="role")) == {"planner", "worker", "review/critic"}
    # split_by="node": no conversation mixes two nodes (the main one is the last node's)
    assert len(trajectory.additional_histories) == 3
    for history in trajectory.additional_histories:
        assert len({c.source.node_path for c in history.llm_calls}) == 1
    again = art.Trajectory.from_json(trajectory.to_json())
    assert [c.source for c in again.llm_calls] == sources


@aio
async def test_create_agent_calls_come_from_its_model_node_and_art_role_marks_them() -> None:
    from langchain.agents import create_agent

    def lookup(city: str) -> str:
        """Look a city up."""
        return f"{city}: sunny"

    script = [
        Reply(tool_calls=[{"name": "lookup", "arguments": {"city": "Oslo"}, "id": "c1"}]),
        Reply(content="Sunny."),
    ]
    with ScriptedServer(script) as server:
        llm = ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_retries=0)
        agent = create_agent(llm, tools=[lookup])

        @wrap_rollout(art_model(server))
        async def rollout() -> float:
            with art.role("solver"):
                await agent.ainvoke({"messages": [{"role": "user", "content": "Weather in Oslo?"}]})
            return 1.0

        trajectory = await rollout()
    assert [(c.source.node, c.source.role, c.source.framework) for c in trajectory.llm_calls] == [
        ("model", "solver", "langgraph"),
        ("model", "solver", "langgraph"),
    ]


def agents_script() -> list[Reply]:
    return [
        Reply(tool_calls=[{"name": "transfer_to_billing", "arguments": {}, "id": "h1"}]),
        Reply(tool_calls=[{"name": "ask_expert", "arguments": {"input": "rate?"}, "id": "t1"}]),
        Reply(content="The rate is 4%."),
        Reply(content="Billing: 4%."),
    ]


def billing_agents(server: ScriptedServer) -> Agent[Any]:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    model = OpenAIResponsesModel(model="m", openai_client=client)  # the SDK's default model kind
    expert = Agent(name="expert", instructions="Answer rates.", model=model)
    billing = Agent(
        name="billing",
        instructions="Handle billing.",
        model=model,
        tools=[expert.as_tool(tool_name="ask_expert", tool_description="Ask the rates expert.")],
    )
    return Agent(name="triage", instructions="Route.", model=model, handoffs=[billing])


@pytest.mark.parametrize("streamed", [False, True])
@aio
async def test_agents_sdk_handoffs_and_agents_as_tools_on_the_responses_model(streamed: bool) -> None:
    with ScriptedServer(agents_script()) as server:
        triage = billing_agents(server)

        @agents_rollout(art_model(server), request_token_ids=True, split_by="agent")
        async def rollout() -> float:
            if streamed:
                result = Runner.run_streamed(triage, "What is the rate?")
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(triage, "What is the rate?")
            return float(result.final_output == "Billing: 4%.")

        trajectory = await rollout()
    calls = trajectory.llm_calls
    assert trajectory.reward == 1.0 and len(calls) == 4
    # the agent used as a tool runs its own (non-streamed) Runner.run inside the outer run
    assert [(c.api, c.stream, c.error) for c in calls] == [
        ("responses", s, None) for s in (streamed, streamed, False, streamed)
    ]
    assert [(c.source.agent, c.source.agent_path, c.source.handoffs) for c in calls] == [
        ("triage", ["triage"], []),
        ("billing", ["billing"], ["triage"]),
        ("expert", ["billing", "expert"], []),
        ("billing", ["billing"], ["triage"]),
    ]
    for (
        call
    ) in calls:  # vLLM's token extras captured: the scripted ids are the bytes of a canonical rendering
        assert call.prompt_token_ids and call.completion_token_ids
        message = call.response_message() or {}
        if message.get("tool_calls"):
            assert call.logprobs is None  # vLLM gives none for function calls: trained on-policy
        else:
            assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)
    assert calls[3].prompt_token_ids[: len(calls[1].prompt_token_ids)] == calls[1].prompt_token_ids  # type: ignore[index]
    # the SDK's tools (handoffs, agents as tools) are strict: vLLM samples their calls under a grammar, so no call
    # offering them keeps an importance ratio
    for call in calls:
        offered = bool(call.request.get("tools"))
        assert ("strict tools" in (excluded_reason(call.request, call.logprobs_mode) or "")) == offered
    assert [bool(c.request.get("tools")) for c in calls] == [True, True, False, True]
    histories = trajectory.histories(by="agent")
    assert {k: sum(len(h.llm_calls) for h in v) for k, v in histories.items()} == {
        "triage": 1,
        "billing": 2,
        "expert": 1,
    }
    main = trajectory.messages()
    assert main[-1] == {"role": "assistant", "content": "Billing: 4%."}
    assert any(m.get("role") == "tool" and m.get("content") == "The rate is 4%." for m in main)


@aio
async def test_two_runs_in_one_rollout_have_their_own_handoff_chains() -> None:
    """Each `Runner.run` is its own trace (a fresh no-op trace with tracing disabled): the second run's handoff
    chain starts again; runs under one user `trace(...)` continue one chain."""
    from agents import trace

    with ScriptedServer(agents_script() * 4) as server:
        triage = billing_agents(server)

        @agents_rollout(art_model(server))
        async def rollout() -> float:
            await Runner.run(triage, "What is the rate?")
            await Runner.run(triage, "And now?")
            with trace("one conversation"):
                await Runner.run(triage, "Rate?")
                await Runner.run(triage, "Again?")
            return 1.0

        trajectory = await rollout()
    sources = [c.source for c in trajectory.llm_calls]
    assert len(sources) == 16 and all(s.trace_id for s in sources)
    one_run = [[], ["triage"], [], ["triage"]]
    assert [s.handoffs for s in sources[:8]] == one_run * 2
    assert len({s.trace_id for s in sources[:4]}) == 1 and sources[0].trace_id != sources[4].trace_id
    assert len({s.trace_id for s in sources[8:]}) == 1  # the user's trace holds both runs
    assert [s.handoffs for s in sources[8:12]] == one_run
    assert sources[12].handoffs == [
        "triage",
        "billing",
    ]  # one conversation: its first run went triage, billing


@aio
async def test_responses_capture_json_stream_and_a_cut_stream() -> None:
    script = [Reply(content="hello"), Reply(content="streamed answer")]
    script.append(Reply(content="never finished", cut_stream_after=3))
    with ScriptedServer(script) as server:
        http = httpx.AsyncClient(transport=AsyncRecordingTransport(request_token_ids=True))
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", http_client=http, max_retries=0)
        async with art.capture() as trajectory:
            with art.role("greeter"):
                await client.responses.create(model="m", input="hi", instructions="Be brief.")
            stream = await client.responses.create(model="m", input="more", stream=True)
            async for _ in stream:
                pass
            with pytest.raises((httpx.HTTPError, openai.APIError)):
                stream = await client.responses.create(model="m", input="again", stream=True)
                async for _ in stream:
                    pass
        sent = server.requests
    first, second, cut = trajectory.llm_calls
    assert (
        sent[0]["enable_response_messages"] is True and "message.output_text.logprobs" in sent[0]["include"]
    )
    assert first.source.role == "greeter" and first.source.framework == "openai"
    assert first.request_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert first.response_message() == {"role": "assistant", "content": "hello"}
    assert bytes(first.completion_token_ids or []).decode() == "hello<|end|>"
    assert (
        second.stream and second.error is None and second.response_message()["content"] == "streamed answer"
    )  # type: ignore[index]
    assert bytes(second.prompt_token_ids or []).decode().endswith("more<|end|><|assistant|>")
    assert cut.error and "incomplete" in cut.error and cut.completion_token_ids is None
    assert trajectory.messages()[-1]["content"] in ("hello", "streamed answer")


@aio
async def test_agents_sdk_span_ids_become_run_ids_when_tracing_is_on() -> None:
    from agents import set_trace_processors

    set_trace_processors([])  # real spans, exported nowhere
    set_tracing_disabled(False)
    try:
        with ScriptedServer(agents_script()) as server:
            triage = billing_agents(server)

            @agents_rollout(art_model(server))
            async def rollout() -> float:
                await Runner.run(triage, "What is the rate?")
                return 1.0

            trajectory = await rollout()
    finally:
        set_tracing_disabled(True)
    sources = [c.source for c in trajectory.llm_calls]
    assert [s.agent for s in sources] == ["triage", "billing", "expert", "billing"]
    assert all(s.run_id and s.run_id.startswith("span_") for s in sources)
    assert all(s.parent_run_id and s.parent_run_id.startswith("span_") for s in sources)
    assert len({s.run_id for s in sources}) == 4 and sources[1].parent_run_id == sources[3].parent_run_id
    assert sources[2].parent_run_id != sources[1].parent_run_id  # the expert's own agent span


def test_responses_logprobs_of_a_cut_tail_are_unknown_not_dropped() -> None:
    """vLLM outputs no logprob for the stop token, nor for a last character whose bytes the token limit cut (held
    back from the text): those become NaN at the tail of a text answer; a function-call answer keeps none."""
    import math

    from art_adapters.apis.responses import token_fields

    part = {"type": "output_text", "text": "ab", "logprobs": [{"logprob": -0.5}, {"logprob": -0.25}]}
    body: dict[str, Any] = {
        "output": [{"type": "message", "content": [part]}],
        "output_messages": [{"tokens": [1, 2, 3, 4]}],
    }
    logprobs = token_fields(body)["logprobs"]
    assert logprobs[:2] == [-0.5, -0.25] and all(math.isnan(x) for x in logprobs[2:]) and len(logprobs) == 4
    # a stream drops the logprobs of steps with empty text anywhere (a byte inside a multi-byte character):
    # only a completed stream missing exactly its stop token's is aligned; anything else is unknown
    assert token_fields(body, streamed=True)["logprobs"] is None
    body["output_messages"] = [{"tokens": [1, 2, 3]}]
    assert token_fields(body, streamed=True)["logprobs"] is None  # status unknown: maybe a cut, not a stop
    body["status"] = "completed"
    logprobs = token_fields(body, streamed=True)["logprobs"]
    assert logprobs[:2] == [-0.5, -0.25] and math.isnan(logprobs[2])
    body["output"].append({"type": "function_call", "name": "f", "arguments": "{}"})
    assert token_fields(body)["logprobs"] is None
    # vLLM attaches every sampled token's logprob to the text, tool-call tokens too: a full list is recovered
    body["output_messages"] = [{"tokens": [1, 2]}]
    assert token_fields(body)["logprobs"] == [-0.5, -0.25]
