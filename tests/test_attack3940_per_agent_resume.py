"""Attack on per-agent resume (issue 39): resuming a checkpoint that holds no agent (a run trained with one shared
adapter) with a fixed `PerAgent(agents=...)` list starts every listed agent fresh, from the base policy, while the
trained weights stay on the shared adapter; that change of agent set must be told, as any other is."""

from __future__ import annotations

import logging

import pytest

import art_adapters as art
from art_adapters.config import LoRAConfig
from art_adapters.tiny import tiny_model_path

pytestmark = pytest.mark.train


def test_resuming_a_single_adapter_checkpoint_with_listed_agents_is_told(tmp_path, caplog) -> None:
    from art_adapters.training.per_agent import PerAgentTrainer
    from art_adapters.training.trainer import Trainer

    lora = LoRAConfig(rank=4, alpha=8)
    single = Trainer(tiny_model_path(), lora, engine="peft")
    path = single.save(tmp_path / "0003")
    single.close()
    per = PerAgentTrainer(tiny_model_path(), lora, per_agent=art.PerAgent(by="role", agents=["planner"]))
    with caplog.at_level(logging.WARNING):
        per.load(path)
    assert "fresh adapters: ['planner']" in caplog.text, caplog.text
    assert per.agents == ["planner"]
    per.close()
