"""The step guard and the off-policy weights (issue 37 §4): `max_token_drop` is the largest fall of a trained token's
probability over one update, the guard scales an update back to a bound, `max_stale_drop` reads the stale tokens,
and the sign-aware (TOPR) weight never discounts a positive-advantage token."""

from __future__ import annotations

import pytest
import torch

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.loss import StepTotals, policy_loss
from art_adapters.training.step_guard import StepGuard, token_drop
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import TrajectoryGroup
from test_trainer import HEAD, rollouts

pytestmark = pytest.mark.train


def test_token_drop_is_the_largest_fall_in_probability() -> None:
    before = torch.tensor([0.9, 0.5, 0.1]).log()
    after = torch.tensor([0.2, 0.6, 0.05]).log()
    assert token_drop(before, after) == pytest.approx(0.7)
    assert token_drop(after, after) == 0.0  # nothing fell
    assert token_drop(torch.empty(0), torch.empty(0)) == 0.0


def test_the_guard_scales_an_update_back_along_its_line() -> None:
    """A one-parameter 'policy' p = sigmoid(theta): the update theta 3 -> -3 drops p by 0.9; bounded at 0.1 the guard
    lands on the line between, within 3 tries, and reports the scale it kept."""
    theta = torch.tensor([3.0])
    guard = StepGuard([theta], max_drop=0.1)
    guard.before_update()
    theta.fill_(-3.0)
    p_before = torch.sigmoid(torch.tensor(3.0))
    calls: list[float] = []

    def measure() -> float:
        calls.append(float(theta))
        return float(p_before - torch.sigmoid(theta[0]))

    metrics = guard.after_update(measure)
    assert metrics["guarded"] == 1.0 and metrics["unguarded_token_drop"] == pytest.approx(0.905, abs=1e-3)
    assert metrics["max_token_drop"] <= 0.1
    assert float(theta) == pytest.approx(3.0 - 6.0 * metrics["step_scale"])
    assert 2 <= len(calls) <= 4  # the first measure, then at most 3 tries


def test_an_update_within_the_bound_is_left_alone() -> None:
    theta = torch.tensor([1.0])
    guard = StepGuard([theta], max_drop=0.5)
    guard.before_update()
    theta.fill_(0.9)
    metrics = guard.after_update(lambda: 0.01)
    assert metrics == {"max_token_drop": 0.01, "step_scale": 1.0, "guarded": 0.0}
    assert float(theta) == pytest.approx(0.9)


@pytest.fixture(scope="module")
def trainer_and_groups() -> tuple[Trainer, list[TrajectoryGroup], object]:
    trainer = Trainer(tiny_model_path(), HEAD, engine="peft")
    groups = rollouts(trainer, seed=5)
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return trainer, groups, state


def trained_logprobs(trainer: Trainer, groups: list[TrajectoryGroup]) -> list[list[float]]:
    out = []
    for group in groups:
        for trajectory in group:
            call = trajectory.llm_calls[0]
            ids = list(call.prompt_token_ids) + list(call.completion_token_ids)
            out.append(trainer.logprobs_of(ids, start=len(call.prompt_token_ids)))
    return out


def reset(trainer: Trainer, state: dict[str, torch.Tensor]) -> None:
    trainer.model.load_state_dict(state)
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=1e-5)
    trainer.step = 0


def test_a_real_step_reports_its_drop_and_the_guard_bounds_it(trainer_and_groups) -> None:
    trainer, groups, state = trainer_and_groups
    big = TrainConfig(learning_rate=2e-3, measure_token_drop=True)
    reset(trainer, state)
    before = trained_logprobs(trainer, groups)
    free = trainer.train_step(groups, big)
    after = trained_logprobs(trainer, groups)
    expected = max(token_drop(torch.tensor(b), torch.tensor(a)) for b, a in zip(before, after, strict=True))
    assert free["max_token_drop"] == pytest.approx(expected, abs=1e-5)
    assert free["max_token_drop"] > 0.015 and free["guarded"] == 0.0  # a step this large overshoots

    reset(trainer, state)
    guarded = trainer.train_step(groups, big.model_copy(update={"max_token_drop": 0.011}))
    after = trained_logprobs(trainer, groups)
    measured = max(token_drop(torch.tensor(b), torch.tensor(a)) for b, a in zip(before, after, strict=True))
    assert guarded["guarded"] == 1.0 and 0 < guarded["step_scale"] < 1
    assert guarded["unguarded_token_drop"] == pytest.approx(free["max_token_drop"], rel=1e-4)
    assert measured == pytest.approx(guarded["max_token_drop"], abs=1e-5) and measured <= 0.011 + 1e-6


def test_without_the_setting_no_measure_runs(trainer_and_groups) -> None:
    trainer, groups, state = trainer_and_groups
    reset(trainer, state)
    metrics = trainer.train_step(groups, TrainConfig(learning_rate=1e-3))
    assert "max_token_drop" not in metrics and "guarded" not in metrics
    assert metrics["max_stale_drop"] == 0.0  # fresh samples: nothing stale


def test_max_stale_drop_reads_only_stale_tokens() -> None:
    new = torch.tensor([0.5, 0.2, 0.9]).log().requires_grad_()
    sampled = torch.tensor([0.9, 0.8, 0.95]).log()
    staleness = torch.tensor([2.0, 0.0, 1.0])
    _, sums = policy_loss(
        new, sampled, torch.ones(3), torch.zeros(3, dtype=torch.long), TrainConfig(), StepTotals(3, 1),
        staleness=staleness,
    )  # fmt: skip
    assert sums["stale_drop_max"] == pytest.approx(0.4)  # token 0 (0.9 -> 0.5); token 1's 0.6 is not stale


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_the_sign_aware_weight_never_discounts_a_good_stale_token(advantage: float) -> None:
    """rho = p_prox / p_behaviour = 0.25: truncated IS weights the token 0.25 either way; sign-aware weights a
    positive-advantage token 1 (its gradient is the on-policy one) and a negative one 0.25."""
    grads = {}
    for mode in ("truncated", "sign_aware"):
        new = torch.tensor([0.2]).log().requires_grad_()
        loss, _ = policy_loss(
            new, torch.tensor([0.8]).log(), torch.tensor([advantage]), torch.zeros(1, dtype=torch.long),
            TrainConfig(behaviour_weight=mode), StepTotals(1, 1),
        )  # fmt: skip
        loss.backward()
        grads[mode] = float(new.grad)
    assert grads["truncated"] == pytest.approx(-advantage * 0.25)
    assert grads["sign_aware"] == pytest.approx(-advantage * (1.0 if advantage > 0 else 0.25))


def test_settings_are_checked() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="max_token_drop"):
            TrainConfig(max_token_drop=bad)
    with pytest.raises(ValueError, match="behaviour_weight"):
        TrainConfig(behaviour_weight="clipped")
    assert LoRAConfig().dropout == 0.0  # the measure's forward equals the step's (no dropout noise)
