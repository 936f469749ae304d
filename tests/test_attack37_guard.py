"""Attack on the step guard (issue 37 §4): with LoRA dropout on, `max_token_drop` must measure the update, not the
dropout's noise between two training-mode forwards, and the guard must not bind on a step that moved nothing."""

from __future__ import annotations

import pytest
import torch

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.step_guard import token_drop
from art_adapters.training.trainer import Trainer
from test_trainer import rollouts

pytestmark = pytest.mark.train


def eval_logprobs(trainer: Trainer, groups: list) -> list[list[float]]:
    out = []
    for group in groups:
        for trajectory in group:
            call = trajectory.llm_calls[0]
            ids = list(call.prompt_token_ids) + list(call.completion_token_ids)
            out.append(trainer.logprobs_of(ids, start=len(call.prompt_token_ids)))
    return out


def test_lora_dropout_is_not_measured_as_a_drop() -> None:
    lora = LoRAConfig(rank=8, alpha=16, modules_to_save=["lm_head"], dropout=0.5)
    trainer = Trainer(tiny_model_path(), lora, engine="peft")
    groups = rollouts(trainer, seed=5)
    trainer.train_step(
        groups, TrainConfig(learning_rate=5e-3)
    )  # LoRA's B nonzero: dropout now changes outputs
    before = eval_logprobs(trainer, groups)
    metrics = trainer.train_step(groups, TrainConfig(learning_rate=1e-9, max_token_drop=0.01))
    after = eval_logprobs(trainer, groups)
    real = max(token_drop(torch.tensor(b), torch.tensor(a)) for b, a in zip(before, after, strict=True))
    assert real < 1e-5  # a step of lr 1e-9 moves nothing
    assert metrics["guarded"] == 0.0 and metrics["step_scale"] == 1.0
    assert metrics["max_token_drop"] == pytest.approx(real, abs=1e-5)


def test_an_update_that_made_probabilities_nan_is_reverted_by_the_guard() -> None:
    """An update that overflowed (NaN weights, so NaN probabilities) has an unbounded drop: the guard, on, goes back
    to the pre-step weights instead of scaling by delta / NaN, which made every weight NaN."""
    from art_adapters.training.step_guard import StepGuard

    theta = torch.tensor([0.5, -1.0])
    guard = StepGuard([theta], max_drop=0.1)
    guard.before_update()
    theta.copy_(torch.tensor([float("nan"), 2.0]))

    def measure() -> float:
        before = torch.tensor([0.6]).log()
        return token_drop(before, torch.sigmoid(theta[:1]).log())

    assert measure() == float("inf")
    metrics = guard.after_update(measure)
    assert torch.equal(theta, torch.tensor([0.5, -1.0]))
    assert metrics["guarded"] == 1.0 and metrics["step_scale"] == 0.0 and metrics["max_token_drop"] <= 0.1
