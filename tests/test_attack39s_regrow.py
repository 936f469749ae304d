"""An agent first seen mid-run on the sharded trainer makes rank 0 write every held adapter's whole state
(weights and AdamW moments) to a temporary checkpoint while the processes rebuild their model. Rank 0 SIGKILLed
in the middle of writing it: the step raises, and once the trainer is closed no copy of that state is left behind
in the temporary directory (it lives in the trainer's private folder, removed with it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.sharded import TrainerProcessError
from art_adapters.training.sharded_agents import ShardedPerAgentTrainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup
from test_sharded_faults import FAST, faults  # noqa: F401 (faults: a fixture)

pytestmark = pytest.mark.train


def calls_by(role: str) -> list[TrajectoryGroup]:
    """One group of two trajectories, each with one call by `role` (the step never gets past its routing)."""
    return [
        TrajectoryGroup(
            [
                Trajectory(
                    llm_calls=[
                        LLMCall(
                            request={"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0},
                            prompt_token_ids=[1, 2, 3],
                            completion_token_ids=[4, 5],
                            logprobs=[-1.0, -1.0],
                            logprobs_mode="processed_logprobs",
                            source=art.CallSource(role=role),
                        )
                    ],
                    reward=float(k),
                )
                for k in range(2)
            ]
        )
    ]


def trainer_holding_a(**more: Any) -> ShardedPerAgentTrainer:
    """Two processes holding agent a's adapter (a step on c's calls rebuilds them)."""
    return ShardedPerAgentTrainer(
        tiny_model_path(),
        LoRAConfig(rank=4, alpha=8),
        per_agent=art.PerAgent(by="role"),
        agents=["a"],
        processes=2,
        seed=3,
        options=FAST,
        **more,
    )


def test_a_rank_killed_while_writing_the_rebuild_checkpoint_leaves_no_copy_behind(
    faults: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the processes' temporary directory
    trainer = trainer_holding_a()
    try:
        assert trainer.agents == ["a"]
        faults.write_text("kill@a 0 train_step")  # rank 0, as it writes a's adapter into the temporary folder
        with pytest.raises(TrainerProcessError, match=r"rank \d exited"):
            trainer.train_step(calls_by("c"), TrainConfig(learning_rate=1e-4))
    finally:
        trainer.close()
    assert not faults.exists()  # the fault fired
    left = sorted(p.name for p in scratch.rglob("art-trainer-grow-*"))
    assert left == [], f"the rebuild's temporary checkpoint outlived the trainer: {left}"
    assert not trainer._folder.exists()


def test_a_rebuild_that_cannot_read_its_checkpoint_back_ends_the_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the temporary checkpoint, the processes' model holds fresh adapters: a failure to read the held
    adapters back (here the folder is gone, an error every process agrees on) must end the processes, so the
    backend resumes from the last checkpoint; answered and carried on, the trainer would stay alive at the same
    step with a's trained weights replaced by fresh ones, and the next checkpoint would save those."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    )
    trainer = trainer_holding_a(worker_module="attack39s_worker")
    try:
        with pytest.raises(TrainerProcessError):
            trainer.train_step(calls_by("c"), TrainConfig(learning_rate=1e-4))
        assert not trainer.alive, "the processes carried on with a's adapter rebuilt fresh"
    finally:
        trainer.close()


def test_the_memory_probe_survives_a_rebuild() -> None:
    """`memory(probe=True)` turns on the probe of resident frozen weights for the next commands; a step that
    brings a new agent rebuilds the model, and the probe must follow it (not report None, as if never asked)."""
    trainer = trainer_holding_a()
    try:
        trainer.memory(probe=True)
        metrics = trainer.train_step(calls_by("c"), TrainConfig(learning_rate=1e-4))
        assert trainer.agents == ["a", "c"] and metrics["agent/c/trained_tokens"] > 0
        for rank in trainer.memory(probe=False):
            assert rank["resident_weight_bytes_peak"], rank
    finally:
        trainer.close()
