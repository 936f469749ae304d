"""Training from production on the tiny model behind real vLLM: a demo-like run's traffic exported to (a local
stand-in of) Langfuse, imported back, and trained the three ways by the examples in examples/production/; our own
traces certify 1.0 (every trained token sampled), foreign ones train only as re-rendered text."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import art_adapters as art
from art_adapters.testing.langfuse_api import LangfuseAPIServer
from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories
from fixtures_vllm import registered_on

pytestmark = [pytest.mark.vllm, pytest.mark.train]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "production"
PROMPTS = ["Say a colour.", "Name an animal."]


def example(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"production_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def traffic(model: art.TrainableModel, per_prompt: int = 4) -> list[art.Trajectory]:
    """Production-like calls through the model's recording client (token ids, logprobs, the serving version)."""
    client = model.openai_client()
    out = []
    for prompt in PROMPTS:
        for k in range(per_prompt):
            with art.Trajectory() as trajectory:
                completion = await client.chat.completions.create(
                    model=model.get_inference_name(),
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=8,
                    seed=k,
                )
            trajectory.finish()
            trajectory.reward = float(len(completion.choices[0].message.content or "") % 3)
            out.append(trajectory)
    return out


async def test_production_round_trip_and_three_ways(vllm_server: Any, tmp_path: Path) -> None:
    public, secret = f"pk-lf-{uuid.uuid4().hex[:8]}", "sk-lf-x"
    async with registered_on(vllm_server, tmp_path, name="prod", project="production") as (_, model):
        recorded = await traffic(model)
        assert all(c.policy_version == 0 and c.prompt_token_ids for t in recorded for c in t.llm_calls)
        with LangfuseAPIServer(public, secret) as langfuse:
            exporter = LangfuseExporter(public, secret, langfuse.base_url, tags=["prod"])
            exporter.export(recorded, step=0)
            assert exporter.flush(30)
            exporter.close()
            assert langfuse.wait_for(len(recorded), scores=len(recorded))
            imported = import_trajectories(public, secret, langfuse.base_url, tags=["prod"], progress=False)
            trajectories = imported.to_list()
        assert imported.stats.own == len(recorded) == len(trajectories)

        # the round trip: the imported trajectories train as the recorded ones (certificate 1.0)
        trainer = await model.backend().trainer(model)  # type: ignore[attr-defined]
        config = art.TrainConfig(learning_rate=1e-4)
        groups = [
            art.TrajectoryGroup(t for t in trajectories if t.messages()[0]["content"] == p) for p in PROMPTS
        ]
        _, metrics = trainer.prepare(groups, config)
        assert metrics["sampled_token_fraction"] == 1.0 and metrics["captured_token_fraction"] == 1.0
        original = [
            art.TrajectoryGroup(t for t in recorded if t.messages()[0]["content"] == p) for p in PROMPTS
        ]
        sequences, _ = trainer.prepare(original, config)
        again, _ = trainer.prepare(groups, config)
        assert sorted(s.input_ids for s in sequences) == sorted(s.input_ids for s in again)

        # 1. SFT on the best traces (step 0 -> 1)
        sft = await example("sft_from_traces").run(model, trajectories, top=0.5)
        assert sft["trained_tokens"] > 0 and await model.get_step() == 1

        # 2. off-policy RL on the recorded traffic: sampled by version 0, trained at step 1 (staleness 1)
        offpolicy = example("offpolicy_from_traffic")
        metrics, stats = await offpolicy.run(model, trajectories, max_staleness=4)
        assert stats.groups == 2 and stats.grouped == len(trajectories)
        assert metrics["sampled_token_fraction"] == 1.0 and metrics["stale_tokens"] > 0
        _, stats = await offpolicy.run(model, trajectories, max_staleness=0)  # too old now: skipped, counted
        assert stats.skipped_stale == len(trajectories) and stats.groups == 0

        # 3. replay: the recorded conversations as scenarios for fresh GRPO rollouts
        (result,) = await example("replay_traces").run(model, trajectories, steps=1, group_size=3)
        assert result["trajectories"] == 6 and await model.get_step() == 3

        # foreign traces (no ids): refused as sampled tokens, trained as re-rendered text only on request
        foreign = [t.model_copy(deep=True) for t in trajectories[:4]]
        for t in foreign:
            t.llm_calls = []
            t.messages_and_choices = t.messages()
        group = [art.TrajectoryGroup(foreign)]
        _, refused = trainer.prepare(group, config)
        assert refused["skipped_trajectories"] == 4
        _, allowed = trainer.prepare(group, art.TrainConfig(train_retokenized_text=True))
        assert allowed["sampled_token_fraction"] == 0.0
