"""The harness inside training: `train_async(..., eval=art.Evaluation(...))` and ART's `PipelineTrainer(eval_fn=...)`
evaluate the scheduled steps with the same statistics, logged per step with the gain over step 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.base import InferenceEndpoint
from art_adapters.evaluation import Reference
from art_adapters.pipeline import PipelineConfig, train_async
from art_adapters.pipeline_trainer import PipelineTrainer
from art_adapters.testing import ScriptedServer
from eval_fakes import IMPROVED, NAME, PROJECT, QUESTIONS, grader, rollout
from pipeline_fakes import Rollouts, TimedBackend


class ServingTimedBackend(TimedBackend):
    """TimedBackend whose every trained step is served by the scripted server as `{project}/{name}@{step}`."""

    def __init__(self, path: Path, base_url: str) -> None:
        super().__init__(path)
        self.base_url = base_url

    async def register(self, model: art.Model) -> InferenceEndpoint:
        model.base_path = str(self.path)
        return InferenceEndpoint(
            base_url=self.base_url,
            api_key="k",
            model_name=f"{model.project}/{model.name}",
            supports_token_ids=False,
        )

    async def checkpoint_steps(self, model: art.TrainableModel) -> list[int]:
        return list(range(self.step + 1))

    async def serve_step(self, model: art.TrainableModel, step: int) -> str:
        return f"{model.project}/{model.name}@{step}"


def history(backend: TimedBackend) -> dict[int, dict[str, Any]]:
    rows = checkpoints.read_history(backend.path / PROJECT / "models" / NAME)
    return {row["step"]: row for row in rows if "val/reward" in row}


async def test_train_async_with_an_evaluation(tmp_path: Path) -> None:
    with ScriptedServer(grader(trained_step=2)) as server:
        backend = ServingTimedBackend(tmp_path, server.base_url)
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
        await model.register(backend)
        reference = Reference(
            model="reference-model", base_url=server.base_url, api_key_env=None, label="big"
        )
        evaluation = art.Evaluation(
            rollout, QUESTIONS, attempts=2, sampling={"temperature": 0.5}, references=[reference]
        )
        await train_async(
            model,
            Rollouts(backend),
            range(100),
            pipeline=PipelineConfig(max_steps=2, groups_per_step=2, eval_every_n_steps=1, eval_at_start=True),
            eval=evaluation,
        )
        baseline_requests = [r for r in server.requests if r["model"].endswith("@0")]
        reference_requests = [r for r in server.requests if r["model"] == "reference-model"]
    assert sorted(evaluation.results) == [0, 1, 2]
    # step 0 and the reference do not change during training: evaluated once and kept
    assert len(baseline_requests) == len(reference_requests) == 2 * len(QUESTIONS)
    two = evaluation.results[2]
    assert [t.target for t in two.targets] == ["step 0", "step 2", "big"]
    assert [(c.a, c.b) for c in two.comparisons] == [("step 0", "step 2"), ("big", "step 2")]
    assert sorted(two.comparisons[0].changes.improved) == sorted(IMPROVED)
    assert len(two.attempts) == 3 * 2 * len(QUESTIONS)
    assert [(c.a, c.b) for c in evaluation.results[0].comparisons] == [("big", "step 0")]
    rows = history(backend)
    assert sorted(rows) == [0, 1, 2]
    assert rows[2]["val/gain"] == pytest.approx(len(IMPROVED) / len(QUESTIONS))
    assert rows[2]["val/improved"] == len(IMPROVED) and rows[1]["val/improved"] == 0
    assert rows[2]["val/reward_ci_low"] <= rows[2]["val/reward"] <= rows[2]["val/reward_ci_high"]
    assert "val/pass@2" in rows[2] and "val/gain" not in rows[0]


async def test_pipeline_trainer_takes_an_evaluation_as_eval_fn(tmp_path: Path) -> None:
    with ScriptedServer(grader(trained_step=2)) as server:
        backend = ServingTimedBackend(tmp_path, server.base_url)
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
        await model.register(backend)
        rollouts = Rollouts(backend)

        async def rollout_fn(model: art.TrainableModel, scenario: int, config: None) -> art.TrajectoryGroup:
            return await rollouts(model, scenario)

        evaluation = art.Evaluation(rollout, QUESTIONS[:5], attempts=1)
        trainer = PipelineTrainer(
            model=model,
            backend=backend,
            rollout_fn=rollout_fn,
            scenarios=iter(range(100)),
            config=None,
            eval_fn=evaluation,
            max_steps=2,
            eval_every_n_steps=2,
            eval_at_start=False,
            min_batch_size=2,
        )
        await trainer.train()
    assert sorted(evaluation.results) == [2]
    assert {"val/gain", "val/reward"} <= set(history(backend)[2])


async def test_an_evaluation_that_would_never_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scenario 0 has no id"):
        art.Evaluation(rollout, [{"question": "?"}])
    with pytest.raises(ValueError, match="attempts must be"):
        art.Evaluation(rollout, QUESTIONS, attempts=0)
    backend = TimedBackend(tmp_path)
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    await model.register(backend)
    with pytest.raises(ValueError, match="would never evaluate"):
        await train_async(model, Rollouts(backend), range(4), eval=art.Evaluation(rollout, QUESTIONS))
    assert backend.step == 0
