"""Per-agent adapters through the async pipeline on the real stack (LocalBackend on the shared vLLM server, tiny
model): each agent's calls are served by its own adapter's newest version while the trainer steps, each step trains
each agent's adapter on exactly its own calls' sampled tokens, every call records the version that sampled it (the
staleness each token trains with), and the run's report shows it per agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.inference import VLLMServer
from art_adapters.pipeline import PipelineConfig, StepReport, train_async
from art_adapters.report import write_report
from test_per_agent_report import Tables

pytestmark = [pytest.mark.vllm, pytest.mark.train, pytest.mark.asyncio(loop_scope="session")]
AGENTS = ("a", "b")


async def call_as(model: art.TrainableModel, agent: str, text: str) -> None:
    with art.role(agent):
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": text}],  # its own history: every sampled token trains
            max_tokens=4,
        )


def agent_tokens(batch: list[art.TrajectoryGroup], agent: str) -> int:
    return sum(
        len(c.completion_token_ids or [])
        for g in batch
        for t in g.trajectories
        for c in t.llm_calls
        if c.source.role == agent
    )


def report_tables(folder: Path) -> dict[str, list[list[str]]]:
    parsed = Tables()
    parsed.feed(write_report(folder).read_text())
    return parsed.tables


@pytest.mark.timeout(1200)
async def test_each_agents_calls_train_its_own_adapter_in_the_async_pipeline(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    backend = art.LocalBackend(tmp_path / "art").use_server(vllm_server)
    model = art.TrainableModel(
        name="duo",
        project="pipe",
        base_model=str(vllm_server.base_model),
        lora=art.LoRAConfig(rank=8, alpha=16),
        adapters=art.PerAgent(by="role", agents=list(AGENTS)),
    )
    await model.register(backend)
    trained: dict[int, list[art.TrajectoryGroup]] = {}
    try:

        async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
            trajectories = []
            for k, reward in enumerate([0.0, 1.0, 0.5, 1.0]):
                async with art.capture() as trajectory:
                    for agent in AGENTS:
                        await call_as(model, agent, f"{agent}: count to {scenario} ({k}).")
                trajectory.reward = reward
                trajectories.append(trajectory)
            return art.TrajectoryGroup(trajectories)

        async def record(report: StepReport, batch: list[art.TrajectoryGroup]) -> None:
            trained[report.step] = batch

        pipeline = PipelineConfig(rollout_workers=2, groups_per_step=1, max_steps=2, max_steps_off_policy=2)
        reports = await asyncio.wait_for(
            train_async(
                model,
                rollout,
                range(100),
                config=art.TrainConfig(learning_rate=5e-2),
                pipeline=pipeline,
                on_step=record,
            ),
            1000,
        )
        assert [r.step for r in reports] == [1, 2]
        for report in reports:
            batch = trained[report.step]
            calls = [c for g in batch for t in g.trajectories for c in t.llm_calls]
            for call in calls:  # each call: its agent's adapter, and the version that sampled it
                assert call.served_model == f"pipe/duo.{call.source.role}@{call.policy_version}"
                assert 0 <= call.policy_version < report.step  # type: ignore[operator]
            for trajectory in (t for g in batch for t in g.trajectories):
                versions = [c.policy_version for c in trajectory.llm_calls]
                assert trajectory.initial_policy_version == min(versions)  # type: ignore[type-var]
            assert report.metrics["adapters_trained"] == 2
            for agent in AGENTS:  # each adapter trained on exactly its own calls' sampled tokens
                assert report.metrics[f"agent/{agent}/trained_tokens"] == agent_tokens(batch, agent) > 0
            assert "agent/shared/trained_tokens" not in report.metrics
            tokens = [len(c.completion_token_ids or []) for c in calls]
            expected = sum(
                (report.step - 1 - c.policy_version) * n for c, n in zip(calls, tokens, strict=True)
            )  # type: ignore[operator]
            assert report.metrics["token_steps_off_policy"] == pytest.approx(expected / sum(tokens))
        folder = backend.model_dir(model)
        final = checkpoints.checkpoint_dir(folder, 2)
        assert checkpoints.checkpoint_agents(final) == list(AGENTS)
    finally:
        await backend.close()
    tables = report_tables(folder)
    assert {(row[0], row[1]) for row in tables["agent-steps"] if row} >= {
        (str(s), a) for s in (1, 2) for a in AGENTS
    }
    assert {row[2] for row in tables["agent-calls"] if row} == set(AGENTS)
