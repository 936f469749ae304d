"""Per-agent adapters, capture side: the switch's rules (keys, names, refusals) and the rewrite of each request's
model name to its agent's adapter, in-process (wrap_rollout over a LangGraph graph with two same-named subgraph
nodes, `model.openai_client()` with `art.role`) and through the recording endpoint, against a real HTTP server."""

from __future__ import annotations

from typing import Any, TypedDict

import httpx
import pytest

import art_adapters as art
from art_adapters.agent_adapters import SHARED, AgentRouting, adapter_name
from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.langgraph import wrap_rollout
from art_adapters.testing import Reply, ScriptedServer

aio = pytest.mark.asyncio


def routed_model(server: ScriptedServer, per_agent: art.PerAgent, served: list[str]) -> art.TrainableModel:
    """A TrainableModel pointed at `server`, as a backend leaves it after publishing `served` agents' adapters."""
    model = art.TrainableModel(
        name="m",
        project="p",
        base_model="unused",
        adapters=per_agent,
        inference_base_url=server.base_url,
        inference_api_key="x",
        inference_model_name="p/m",
    )
    model.route_agents("p/m", served)
    return model


def test_keys_names_and_refusals() -> None:
    source = art.CallSource(framework="langgraph", node="llm", checkpoint_ns="research:1|llm:2")
    assert art.PerAgent(by="node").adapter_of(source) == "research_llm-" + adapter_name("research/llm")[-8:]
    assert art.PerAgent(by="agent").adapter_of(source) == SHARED  # no agent: the shared adapter
    assert art.PerAgent(by="role").adapter_of(art.CallSource(role="planner")) == "planner"
    listed = art.PerAgent(by="role", agents=["planner"])
    assert listed.adapter_of(art.CallSource(role="executor")) == SHARED  # not listed: shared
    assert (
        art.PerAgent(by=lambda s: (s.role or "").upper() or None).adapter_of(art.CallSource(role="a")) == "A"
    )
    # sanitized names are stable and distinct; valid ones are kept as they are
    assert adapter_name("Research Agent") == adapter_name("Research Agent") != adapter_name("Research_Agent")
    assert adapter_name("ok-name_1") == "ok-name_1"
    with pytest.raises(ValueError, match="name the same adapter"):
        art.PerAgent(agents=["a b", "a b"])
    with pytest.raises(ValueError, match="lists no agent"):
        art.PerAgent(agents=[])
    with pytest.raises(ValueError, match="'agent', 'node', 'role'"):
        art.PerAgent(by="nodes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a str or None"):
        art.PerAgent(by=lambda s: 3).adapter_of(art.CallSource())  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="modules_to_save"):
        art.TrainableModel(
            name="m",
            base_model="x",
            adapters=art.PerAgent(),
            lora=art.LoRAConfig(modules_to_save=["lm_head"]),
        )


def test_only_the_models_own_names_of_served_agents_are_rewritten() -> None:
    routing = AgentRouting(art.PerAgent(by="role"), "p/m", "m")
    planner = art.CallSource(role="planner")
    assert routing.rewrite("p/m", planner) is None  # not served yet: stays on the shared adapter
    routing.set_served(["planner"])
    assert routing.rewrite("p/m", planner) == "p/m.planner"
    assert routing.rewrite("m@3", planner) == "p/m.planner@3"
    assert routing.rewrite("judge", planner) is None  # another model: untouched
    assert routing.rewrite("p/m", art.CallSource()) is None


class State(TypedDict):
    messages: list[dict[str, Any]]


def _subgraph(llm: Any) -> Any:
    from langgraph.graph import END, START, StateGraph

    async def call(state: State) -> State:
        answer = await llm.ainvoke(state["messages"])
        return {"messages": [*state["messages"], {"role": "assistant", "content": answer.content}]}

    graph = StateGraph(State)
    graph.add_node("llm", call)
    graph.add_edge(START, "llm")
    graph.add_edge("llm", END)
    return graph.compile()


@aio
async def test_two_subgraphs_same_node_name_each_to_its_adapter_in_process() -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    script = [Reply(content="plan"), Reply(content="done")]
    with ScriptedServer(script) as server:
        model = routed_model(server, art.PerAgent(by="node"), [])
        research, write = adapter_name("research/llm"), adapter_name("write/llm")
        model.route_agents("p/m", [research, write])
        llm = ChatOpenAI(
            model=model.get_inference_name(), base_url=server.base_url, api_key="x", max_retries=0
        )
        outer = StateGraph(State)
        outer.add_node("research", _subgraph(llm))
        outer.add_node("write", _subgraph(llm))
        outer.add_edge(START, "research")
        outer.add_edge("research", "write")
        outer.add_edge("write", END)
        graph = outer.compile()

        @wrap_rollout(model)
        async def rollout() -> None:
            await graph.ainvoke({"messages": [{"role": "user", "content": "go"}]})

        trajectory = await rollout()
    assert [r["model"] for r in server.requests] == [f"p/m.{research}", f"p/m.{write}"]
    assert [c.source.node_path for c in trajectory.llm_calls] == ["research/llm", "write/llm"]
    assert [c.model for c in trajectory.llm_calls] == [f"p/m.{research}", f"p/m.{write}"]


@aio
async def test_openai_client_routes_by_role_and_leaves_the_rest_shared() -> None:
    with ScriptedServer([Reply(content="a"), Reply(content="b"), Reply(content="c")]) as server:
        model = routed_model(server, art.PerAgent(by="role", agents=["planner", "executor"]), ["planner"])
        client = model.openai_client()
        messages = [{"role": "user", "content": "hi"}]
        async with art.capture():
            with art.role("planner"):
                await client.chat.completions.create(model="p/m@0", messages=messages)
            with art.role("executor"):  # listed, but its adapter is not served yet
                await client.chat.completions.create(model="p/m", messages=messages)
            await client.chat.completions.create(model="p/m", messages=messages)
    assert [r["model"] for r in server.requests] == ["p/m.planner@0", "p/m", "p/m"]


@aio
async def test_recording_endpoint_routes_by_the_role_header() -> None:
    with ScriptedServer([Reply(content="a"), Reply(content="b")]) as server:
        model = routed_model(server, art.PerAgent(by="role"), ["critic"])
        endpoint = RecordingEndpoint(server.base_url, "x", routing=model.agent_routing()).start()
        try:
            async with art.capture() as trajectory:
                url = endpoint.url()
                async with httpx.AsyncClient() as http:
                    body = {"model": "p/m", "messages": [{"role": "user", "content": "hi"}]}
                    for headers in ({"x-art-role": "critic"}, {}):
                        answer = await http.post(f"{url}/chat/completions", json=body, headers=headers)
                        assert answer.status_code == 200
        finally:
            endpoint.stop()
    assert [r["model"] for r in server.requests] == ["p/m.critic", "p/m"]
    assert [c.source.role for c in trajectory.llm_calls] == ["critic", None]


@aio
async def test_backends_refuse_what_they_cannot_do_before_anything_starts(tmp_path) -> None:
    from art_adapters.inference import InferenceConfig
    from art_adapters.tiny import tiny_model_path

    def model(agents: list[str] | None = None) -> art.TrainableModel:
        return art.TrainableModel(
            name="m", project="p", base_model=str(tiny_model_path()), adapters=art.PerAgent(agents=agents)
        )

    small = art.LocalBackend(tmp_path / "b", inference=InferenceConfig(max_loras=3))
    with pytest.raises(art.UnsupportedPerAgentSetting, match=r"lists 2 agents.*max_loras >= 4.*max_loras=3"):
        await model(["a", "b"]).register(small)
    assert small._servers == {} and not any(tmp_path.rglob("checkpoints"))  # no engine, no trainer, no files


def test_the_async_pipeline_counts_agents_adapters_as_the_models_own() -> None:
    from art_adapters.pipeline.versions import own_names, sampled_spans

    def call(served: str) -> art.LLMCall:
        return art.LLMCall(request={}, completion_token_ids=[1, 2], policy_version=3, served_model=served)

    trajectory = art.Trajectory(llm_calls=[call("p/m.planner@3"), call("p/m@3"), call("p/judge@3")])
    per_agent = art.TrainableModel(name="m", project="p", base_model="x", adapters=art.PerAgent())
    assert list(sampled_spans(trajectory, own_names(per_agent))) == [(3, 2), (3, 2)]  # not the judge's
    single = art.TrainableModel(name="m", project="p", base_model="x")
    assert list(sampled_spans(trajectory, own_names(single))) == [(3, 2)]


async def test_evaluate_refuses_a_per_agent_model_before_any_rollout(tmp_path) -> None:
    """Evaluating a PerAgent model's steps would answer every agent with the shared adapter: refused, not wrong."""
    import art_adapters as art

    model = art.TrainableModel(
        name="m", project="p", base_model="base", adapters=art.PerAgent(by="agent", agents=["a"])
    )
    called: list[str] = []

    async def rollout(model: object, scenario: dict) -> art.Trajectory:
        called.append(scenario["id"])
        raise AssertionError("no rollout may run")

    with pytest.raises(ValueError, match="per-agent adapters"):
        await art.evaluate(model, rollout, [{"id": "s1"}], steps=[0, "latest"], progress=False)
    assert called == []
