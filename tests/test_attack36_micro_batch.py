"""A decision the plan prints must be applied (found by the outside attack on issue 36): the plan's micro-batch
budget, for which it sized the activations, reaches the trainer as a cap on each step's
TrainConfig.micro_batch_tokens (4096 unless set), so a tight card never packs more than it planned for."""

from __future__ import annotations

import inspect

import pytest

from art_adapters.backend.placement import trainer_settings
from art_adapters.gpu_plan import Plan
from art_adapters.training.trainer import Trainer

TIGHT = Plan(
    model="m",
    placement="shared",
    gpu_count=1,
    gpu_memory_gib=23.6,
    trainer_gpu_ids=[0],
    inference_gpu_ids=[0],
    gpu_memory_utilization=0.886,
    enable_sleep_mode=True,
    max_seq_len=2048,
    gradient_checkpointing=True,
    logprob_chunk_tokens=256,
    micro_batch_tokens=2048,
)


def test_the_plans_micro_batch_budget_reaches_the_trainer() -> None:
    assert "micro_batch_tokens" in inspect.signature(Trainer).parameters
    assert trainer_settings(TIGHT, Trainer).get("micro_batch_tokens") == 2048


def test_a_step_packs_at_most_the_trainers_budget() -> None:
    """The plan's budget caps what a step's TrainConfig asks (4096 by default); a smaller ask is kept."""
    from art_adapters.config import TrainConfig
    from art_adapters.tiny import tiny_model_path
    from test_trainer import HEAD, rollouts

    trainer = Trainer(tiny_model_path(), HEAD, engine="peft", micro_batch_tokens=64)
    assert trainer.micro_batch_budget(4096) == 64 and trainer.micro_batch_budget(32) == 32
    groups = rollouts(trainer, seed=2)
    capped = trainer.train_step(groups, TrainConfig(learning_rate=1e-5))
    assert capped["micro_batches"] > 1  # 16 sequences of ~30 tokens: one micro-batch of 4096, several of 64
    uncapped = Trainer(tiny_model_path(), HEAD, engine="peft").train_step(
        groups, TrainConfig(learning_rate=1e-5)
    )
    assert uncapped["micro_batches"] == 1
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        Trainer(tiny_model_path(), HEAD, engine="peft", micro_batch_tokens=-5)
