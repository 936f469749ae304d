"""art.evaluate on the tiny model behind real vLLM: step 0 (the untrained adapter) against a step trained through
LocalBackend, each served as its own version; the evaluation's seeds give every rerun the same draws."""

from __future__ import annotations

import math
from typing import Any

import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from fixtures_vllm import registered_on, sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")
SCENARIOS = [{"id": f"s{i}", "prompt": p} for i, p in enumerate(["hi", "Say a number.", "weather?"])]
SAMPLING = {"temperature": 1.0, "max_tokens": 6, "seed": 5}


@aio
async def test_step_0_against_a_trained_step(vllm_server: VLLMServer, tmp_path: Any) -> None:
    served: list[tuple[str, str]] = []  # (the name the rollout asked for, the version that answered)

    async def rollout(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        messages = [{"role": "user", "content": scenario["prompt"]}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=32, temperature=0.7
        )
        choice = completion.choices[0]
        served.append((model.get_inference_name(), (choice.model_extra or {}).get("served_model")))
        assert (
            completion.usage.completion_tokens <= SAMPLING["max_tokens"]
        )  # the evaluation's, not the rollout's
        text = choice.message.content or ""
        reward = sum(c < "n" for c in text) / max(len(text), 1)
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    async with registered_on(vllm_server, tmp_path, name="evaluated", project="eval") as (backend, model):
        await model.train(
            [await sampled_group(model, [0.0, 1.0, 0.3, 0.6])], config=art.TrainConfig(learning_rate=5e-3)
        )
        assert await model.get_step() == 1
        result = await art.evaluate(model, rollout, SCENARIOS, attempts=2, sampling=SAMPLING, progress=False)
        again = await art.evaluate(
            model, rollout, SCENARIOS, attempts=2, steps=[0], sampling=SAMPLING, progress=False
        )
        assert model.get_inference_name() == "eval/evaluated"  # the user's model still names the newest
        # ART's delete_checkpoints() keeps the latest and the best: step 0's checkpoint goes, the base model stays
        assert await model.delete_checkpoints() == [0]
        rebuilt = await art.evaluate(
            model, rollout, SCENARIOS, attempts=2, steps=[0], sampling=SAMPLING, progress=False
        )

    assert [t.target for t in result.targets] == ["step 0", "step 1"]
    assert all(a.error is None and math.isfinite(a.reward) for a in result.attempts)
    assert {t.scenarios for t in result.targets} == {len(SCENARIOS)}
    (comparison,) = result.comparisons
    changes = comparison.changes
    assert len(changes.improved) + len(changes.same) + len(changes.worse) == len(SCENARIOS)
    assert math.isfinite(comparison.diff.mean)
    # each step answered from its own version on the one engine
    assert {pair for pair in served} == {
        ("eval/evaluated@0", "eval/evaluated@0"),
        ("eval/evaluated@1", "eval/evaluated@1"),
    }
    # the same seeds per (scenario, attempt): a rerun of step 0 draws exactly the same answers
    first = {(a.scenario_id, a.attempt): a.messages for a in result.attempts if a.target == "step 0"}
    rerun = {(a.scenario_id, a.attempt): a.messages for a in again.attempts}
    assert first == rerun
    # the base model served again from the newest adapter with a zero update: the same answers, draw for draw
    assert {(a.scenario_id, a.attempt): a.messages for a in rebuilt.attempts} == first


@aio
async def test_a_langgraph_agent_through_its_unchanged_decorator(
    vllm_server: VLLMServer, tmp_path: Any
) -> None:
    """A LangGraph agent on its own ChatOpenAI (the model's name hard-coded, as when it was trained), decorated
    with `art.langgraph.wrap_rollout`: each step's attempts are answered by that step's version."""
    pytest.importorskip("langgraph")
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph

    from art_adapters.langgraph import wrap_rollout

    async with registered_on(vllm_server, tmp_path, name="graph", project="eval") as (backend, model):
        await model.train(
            [await sampled_group(model, [0.0, 1.0, 0.3, 0.6])], config=art.TrainConfig(learning_rate=5e-3)
        )
        llm = ChatOpenAI(
            base_url=model.inference_base_url,
            api_key=model.inference_api_key,
            model="eval/graph",
            max_tokens=32,
            max_retries=0,
        )

        async def agent(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await llm.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", agent)
        graph.add_edge(START, "agent")
        compiled = graph.compile()

        @wrap_rollout(model)
        async def graph_rollout(_: art.Model, scenario: dict[str, Any]) -> float:
            result = await compiled.ainvoke({"messages": [HumanMessage(scenario["prompt"])]})
            text = str(result["messages"][-1].content)
            return sum(c < "n" for c in text) / max(len(text), 1)

        versions: list[tuple[str | None, str | None]] = []

        async def observed(view: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
            trajectory = await graph_rollout(view, scenario)
            versions.append((view.get_inference_name(), trajectory.llm_calls[0].served_model))
            return trajectory

        result = await art.evaluate(
            model,
            observed,
            SCENARIOS[:2],
            attempts=2,
            sampling={"temperature": 0, "max_tokens": 4},
            progress=False,
        )
    assert [t.target for t in result.targets] == ["step 0", "step 1"]
    assert all(a.error is None for a in result.attempts)
    assert set(versions) == {("eval/graph@0", "eval/graph@0"), ("eval/graph@1", "eval/graph@1")}
