"""Attack on "every decision can be overridden" read the other way: a decision the plan prints must be applied.
The plan decides the micro-batch token budget (and budgets activations for it), but nothing hands it to the
trainer: LocalBackend's steps pack TrainConfig.micro_batch_tokens (4096 unless set), more than the plan's budget
where it chose fewer (a tight card at a short max_seq_len), and far less where it chose more."""

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


@pytest.mark.xfail(
    strict=True,
    reason="the plan's micro_batch_tokens reaches no trainer: Trainer takes no budget and TrainConfig's default "
    "(4096) is packed whatever the plan chose; whether an unset TrainConfig.micro_batch_tokens should take the "
    "plan's (and how a remote config tells 'unset' from 4096) is a design decision",
)
def test_the_plans_micro_batch_budget_reaches_the_trainer() -> None:
    assert "micro_batch_tokens" in inspect.signature(Trainer).parameters
    assert trainer_settings(TIGHT, Trainer).get("micro_batch_tokens") == 2048
