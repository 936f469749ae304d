"""Per-agent adapters with a real multi-agent library, its code unchanged: a `langgraph-supervisor` supervisor with
two named workers, captured by `wrap_rollout` (each worker's calls routed to its own adapter's served name, the
supervisor's to the shared one), then one per-agent step on the tiny model trains each adapter on its own calls.
The engine is a scripted OpenAI-compatible server (its token ids are bytes the tiny model's vocabulary holds)."""

from __future__ import annotations

import pytest
import torch
from langchain_openai import ChatOpenAI

import art_adapters as art
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.langgraph import wrap_rollout
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from test_multi_agent import SUPERVISOR_SCRIPT, workers

pytestmark = pytest.mark.train
aio = pytest.mark.asyncio


@aio
async def test_a_supervisor_and_two_workers_train_one_step_each_on_its_own_adapter() -> None:
    from langgraph_supervisor import create_supervisor

    per_agent = art.PerAgent(by="agent", agents=["research_expert", "math_expert"])
    # the second rollout's answers differ from the first's for every agent: a gradient for each to take
    second = list(SUPERVISOR_SCRIPT)
    second[2], second[5], second[6] = (
        Reply(content="Paris: 2M."),
        Reply(content="It is 5."),
        Reply(content="Done."),
    )
    with ScriptedServer(SUPERVISOR_SCRIPT + second) as server:
        model = art.TrainableModel(
            name="m",
            project="p",
            base_model=str(tiny_model_path()),
            adapters=per_agent,
            inference_base_url=server.base_url,
            inference_api_key="x",
            inference_model_name="p/m",
        )
        model.route_agents("p/m", per_agent.listed())  # what LocalBackend does once it serves them
        llm = ChatOpenAI(
            model=model.get_inference_name(), base_url=server.base_url, api_key="x", max_retries=0
        )
        supervisor = create_supervisor(workers(llm), model=llm, prompt="You manage experts.").compile()

        @wrap_rollout(model, request_token_ids=True)
        async def rollout() -> None:
            await supervisor.ainvoke(
                {"messages": [{"role": "user", "content": "Population of Paris, and 2+3?"}]}
            )

        trajectories = [await rollout(), await rollout()]
    sent = [r["model"] for r in server.requests[:7]]
    assert sent.count("p/m.research_expert") == 2 and sent.count("p/m.math_expert") == 2
    assert sent.count("p/m") == 3  # the supervisor (no agent name) stays on the shared adapter
    trajectories[0].reward, trajectories[1].reward = 1.0, 0.0

    trainer = PerAgentTrainer(tiny_model_path(), LoRAConfig(rank=4, alpha=8), per_agent=per_agent)
    before = {a: [p.detach().clone() for p in trainer.slots[a].params] for a in trainer.slots}
    metrics = trainer.train_step(
        [art.TrajectoryGroup(trajectories)], TrainConfig(learning_rate=1e-2, train_retokenized_text=False)
    )
    assert metrics["step"] == trainer.step == 1 and metrics["adapters_trained"] == 3
    for adapter, name in (
        ("research_expert", "research_expert"),
        ("math_expert", "math_expert"),
        ("", "shared"),
    ):
        calls = [c for t in trajectories for c in t.llm_calls if per_agent.adapter_of(c.source) == adapter]
        assert metrics[f"agent/{name}/trained_tokens"] == sum(
            len(c.completion_token_ids or []) for c in calls
        )
        moved = [
            not torch.equal(a, p) for a, p in zip(before[adapter], trainer.slots[adapter].params, strict=True)
        ]
        assert any(moved), adapter


@aio
async def test_an_agents_sdk_handoff_pair_trains_one_step_each_on_its_own_adapter() -> None:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    from art_adapters.openai_agents import wrap_rollout as agents_rollout

    set_tracing_disabled(True)
    handoff = Reply(tool_calls=[{"name": "transfer_to_billing", "arguments": {}, "id": "h1"}])
    script = [handoff, Reply(content="Billing: 4%."), handoff, Reply(content="It is 5%.")]
    per_agent = art.PerAgent(by="agent")
    with ScriptedServer(script) as server:
        model = art.TrainableModel(
            name="m",
            project="p",
            base_model=str(tiny_model_path()),
            adapters=per_agent,
            inference_base_url=server.base_url,
            inference_api_key="x",
            inference_model_name="p/m",
        )
        model.route_agents("p/m", ["triage", "billing"])
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        llm = OpenAIChatCompletionsModel(model=model.get_inference_name(), openai_client=client)
        billing = Agent(name="billing", instructions="Handle billing.", model=llm)
        triage = Agent(name="triage", instructions="Route.", model=llm, handoffs=[billing])

        @agents_rollout(model, request_token_ids=True)
        async def rollout() -> None:
            await Runner.run(triage, "What is the rate?")

        trajectories = [await rollout(), await rollout()]
    assert [r["model"] for r in server.requests] == ["p/m.triage", "p/m.billing"] * 2
    trajectories[0].reward, trajectories[1].reward = 1.0, 0.0
    trainer = PerAgentTrainer(tiny_model_path(), LoRAConfig(rank=4, alpha=8), per_agent=per_agent)
    fresh = [p.detach().clone() for p in trainer.slots[""].params]  # every adapter's start
    metrics = trainer.train_step([art.TrajectoryGroup(trajectories)], TrainConfig(learning_rate=1e-2))
    assert trainer.agents == ["billing", "triage"] and metrics["step"] == 1
    assert metrics["agent/billing/trained_tokens"] > 0 and metrics["agent/triage/trained_tokens"] > 0
    assert all(
        torch.equal(a, p) for a, p in zip(fresh, trainer.slots[""].params, strict=True)
    )  # no shared call
    billing = trainer.slots["billing"].params
    assert any(
        not torch.equal(a, p) for a, p in zip(fresh, billing, strict=True)
    )  # the triage calls are identical in both rollouts: their gradients cancel
