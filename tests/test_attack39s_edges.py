"""Edge steps on the sharded per-agent trainer (2 gloo processes), against the one-process trainer: a step whose
calls are all the shared adapter's, a step in which no adapter has anything to train (equal rewards), the step
advancing once for each; then the sharded checkpoint resumes in one process with every adapter to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from art_adapters.training.sharded_agents import ShardedPerAgentTrainer
from test_per_agent_training import groups_of, weights
from test_sharded_faults import FAST

pytestmark = pytest.mark.train
LORA = LoRAConfig(rank=4, alpha=8)
CONFIG = TrainConfig(learning_rate=1e-4, micro_batch_tokens=64)
ROLE = art.PerAgent(by="role")


def test_shared_only_and_nothing_to_train_steps_then_a_one_process_resume(tmp_path: Path) -> None:
    single = PerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, adapters=["a"], seed=3)
    shared_only = groups_of(single, [None])
    flat = groups_of(single, ["a", None], seed=1)
    for group in flat:
        for trajectory in group.trajectories:
            trajectory.reward = 0.5  # equal rewards: no advantage, nothing trains
    sharded = ShardedPerAgentTrainer(
        tiny_model_path(), LORA, per_agent=ROLE, agents=["a"], processes=2, seed=3, options=FAST
    )
    try:
        sharded.load(single.save(tmp_path / "0000"))  # one start (their fresh adapters are drawn differently)
        one, two = single.train_step(shared_only, CONFIG), sharded.train_step(shared_only, CONFIG)
        assert one["step"] == two["step"] == sharded.step == 1
        assert two["adapters_trained"] == one["adapters_trained"] == 1 and "agent/a/loss" not in two
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        one, two = single.train_step(flat, CONFIG), sharded.train_step(flat, CONFIG)
        assert one["step"] == two["step"] == sharded.step == 2
        assert two["adapters_trained"] == one["adapters_trained"] == 0
        assert "skipped_reason" in two and "skipped_reason" in one
        sharded.save(tmp_path / "0002")
    finally:
        sharded.close()
    resumed = PerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, seed=3)
    resumed.load(tmp_path / "0002")
    assert resumed.agents == ["a"] and resumed.step == 2
    for peft in ("default", "agent_a"):
        mine, theirs = weights(single, peft), weights(resumed, peft)
        worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
        assert worst < 1e-6, (peft, worst)
    assert resumed.slots[""].optimizer.state  # the shared adapter's AdamW moments came back
    assert not resumed.slots["a"].optimizer.state  # a never stepped: no moments, as in one process
