"""The GRPO-family loss: REINFORCE at weight 1, PPO/DAPO clipping against the proximal policy, GSPO sequence ratios,
CISPO weights, and one truncated behaviour weight for every token, fresh or stale."""

from __future__ import annotations

import math

import pytest
import torch

from art_adapters.config import TrainConfig
from art_adapters.training.loss import (
    RewardError,
    StepTotals,
    group_advantages,
    policy_loss,
    reinforce_loss,
)


def batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logprobs (a leaf), one advantage per sequence, and each token's sequence index."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    new = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    seq_adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return new, seq_adv[index], index


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("variant", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_ratio_one_gradient_equals_reinforce(variant: str, normalization: str, beta: float) -> None:
    lengths = [3, 7, 1, 5]
    new, adv, index = batch(lengths)
    config = TrainConfig(loss=variant, normalization=normalization, beta=beta)
    totals = StepTotals(trained_tokens=sum(lengths), trajectories=len(lengths))
    ref = new.detach().clone() if beta else None  # fresh adapter: the policy is the reference policy
    loss, sums = policy_loss(new, new.detach().clone(), adv, index, config, totals, ref_logprobs=ref)
    expected = grad_of(reinforce_loss(new, adv, index, normalization, totals), new)
    assert torch.allclose(grad_of(loss, new), expected, atol=1e-6, rtol=0)
    assert sums["clipped"] == 0 and sums["ratio"] == pytest.approx(sum(lengths)) and sums["kl"] == 0


def test_unknown_sampled_logprobs_count_as_on_policy() -> None:
    new, adv, index = batch([4, 4])
    totals = StepTotals(8, 2)
    nan = torch.full_like(new.detach(), float("nan"))
    loss, sums = policy_loss(new, nan, adv, index, TrainConfig(), totals)
    assert torch.allclose(grad_of(loss, new), grad_of(reinforce_loss(new, adv, index, "token", totals), new))
    assert sums["ratio"] == pytest.approx(8)


def test_ppo_clipping_zeroes_the_gradient_only_on_the_clipped_side() -> None:
    new = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    log_r = torch.tensor([math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    prox = -log_r  # a proximal policy other than this pass: the ratio new/prox is what the clip bounds
    loss, sums = policy_loss(
        new, prox, adv, torch.arange(4), TrainConfig(epsilon=0.2), StepTotals(4, 4), proximal_logprobs=prox
    )
    g = grad_of(loss, new)
    # r=1.5, A>0: clipped (no push further up); r=1.5, A<0: pulled down; r=0.5, A>0: pushed up; r=0.5, A<0 clipped.
    assert g[0] == 0 and g[3] == 0
    assert g[1] == pytest.approx(1.5 / 4) and g[2] == pytest.approx(-0.5 / 4)
    assert sums["clipped"] == 2


def test_dapo_clip_higher_widens_only_the_upper_range() -> None:
    new = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([math.log(1.25), math.log(0.75)], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    symmetric, _ = policy_loss(
        new, old, adv, torch.arange(2), TrainConfig(epsilon=0.2), StepTotals(2, 2), proximal_logprobs=old
    )
    dapo, sums = policy_loss(
        new,
        old,
        adv,
        torch.arange(2),
        TrainConfig(epsilon=0.2, epsilon_high=0.28),
        StepTotals(2, 2),
        proximal_logprobs=old,
    )
    assert grad_of(symmetric, new).tolist() == [0.0, 0.0]  # 1.25 > 1.2 and 0.75 < 0.8: both clipped
    g = grad_of(dapo, new)
    assert g[0] == pytest.approx(-1.25 / 2) and g[1] == 0  # 1.25 < 1.28 now trains; the lower side unchanged
    assert sums["clipped"] == 1


def test_gspo_uses_the_sequence_geometric_mean_ratio() -> None:
    new = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    log_r = torch.tensor([0.1, -0.1, 0.3, 0.5, 0.5], dtype=torch.float64)  # seq 0 mean 0.1, seq 1 mean 0.5
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 0, 1, 1])
    config = TrainConfig(loss="gspo", epsilon=0.2, normalization="sequence")
    loss, sums = policy_loss(new, -log_r, adv, index, config, StepTotals(5, 2), proximal_logprobs=-log_r)
    g = grad_of(loss, new)
    s0 = math.exp(0.1)
    assert g[:3].tolist() == pytest.approx([-s0 / 3 / 2] * 3)  # every token weighted by the sequence ratio
    assert g[3:].tolist() == [0.0, 0.0]  # exp(0.5) > 1.2 with A>0: the whole sequence is clipped
    assert sums["clipped"] == 2 and sums["ratio"] == pytest.approx(3 * s0 + 2 * math.exp(0.5))


def test_gspo_is_not_eaten_by_the_samplers_bf16_gap() -> None:
    """Sequence gaps the size measured on an H200 in bf16 (mean |gap| 8e-3 for a 0.5B-shaped model, bench/gpu_fidelity.py)
    would put every sequence outside GSPO's published clip 3e-4 / 4e-4 if the ratio were taken against the sampler;
    against the pre-step policy, the gap is a capped weight and every token trains, weighted by it."""
    gaps = torch.tensor([0.008, 0.008, -0.008, -0.008], dtype=torch.float64)  # logp_trainer - logp_sampled
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1])
    config = TrainConfig(loss="gspo")
    assert config.epsilon == 3e-4 and config.clip_high == 4e-4
    new = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    loss, sums = policy_loss(new, -gaps, adv, index, config, StepTotals(4, 2))
    g = grad_of(loss, new)
    assert sums["clipped"] == 0
    assert g.tolist() == pytest.approx([-math.exp(0.008) / 4] * 2 + [math.exp(-0.008) / 4] * 2)


def test_cispo_keeps_gradients_of_clipped_tokens_with_a_clipped_weight() -> None:
    new = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ratios = [3.0, 6.0, 0.5]
    old = -torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    adv = torch.ones(3, dtype=torch.float64)
    config = TrainConfig(loss="cispo", epsilon=0.2)  # epsilon_high defaults to 4.0 for cispo
    loss, sums = policy_loss(new, old, adv, torch.arange(3), config, StepTotals(3, 3), proximal_logprobs=old)
    assert grad_of(loss, new).tolist() == pytest.approx([-3.0 / 3, -5.0 / 3, -0.8 / 3])
    assert sums["clipped"] == 2


def test_kl_penalty_pulls_toward_the_reference() -> None:
    new = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    zero_adv = torch.zeros(2, dtype=torch.float64)
    config = TrainConfig(beta=0.5)
    loss, sums = policy_loss(new, new.detach(), zero_adv, torch.arange(2), config, StepTotals(2, 2), ref)
    delta = ref - new.detach()
    assert sums["kl"] == pytest.approx(float((delta.exp() - delta - 1).sum()))
    g = grad_of(loss, new)
    assert g[0] > 0 and g[1] < 0  # gradient descent moves each logprob toward the reference


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_step_totals_make_micro_batch_splits_sum_to_the_full_gradient(normalization: str) -> None:
    lengths = [3, 7, 1, 5]
    new, adv, index = batch(lengths, seed=3)
    old = (new.detach() + 0.05 * torch.randn(new.shape, dtype=torch.float64)).clone()
    config = TrainConfig(normalization=normalization)
    totals = StepTotals(sum(lengths), len(lengths))
    full, _ = policy_loss(new, old, adv, index, config, totals)
    split = 10  # sequences 0-1 in the first micro-batch, 2-3 in the second
    first, _ = policy_loss(new[:split], old[:split], adv[:split], index[:split], config, totals)
    second, _ = policy_loss(new[split:], old[split:], adv[split:], index[split:] - 2, config, totals)
    assert torch.allclose(grad_of(full, new), grad_of(first + second, new), atol=1e-12)


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert group_advantages([1.0, 0.0], scale_rewards=False) == pytest.approx([0.5, -0.5])  # Dr. GRPO
    assert group_advantages([0.3, 0.3, 0.3]) is None
    assert group_advantages([2.0]) is None
    with pytest.raises(RewardError, match="group 4, trajectory 1: reward is nan"):
        group_advantages([1.0, float("nan")], group_index=4)
    with pytest.raises(RewardError, match="trajectory 0: reward is inf"):
        group_advantages([float("inf"), 1.0])


def test_a_trajectory_split_into_rows_counts_once_for_sequence_normalization_and_gspo() -> None:
    """Two rows of one trajectory (index 0) and one of another (index 1): one unit each."""
    new = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    log_r = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.3], dtype=torch.float64)
    adv = torch.ones(6, dtype=torch.float64)
    unit = torch.tensor([0, 0, 0, 0, 1, 1])  # trajectory 0 has 4 tokens (two rows of 2), trajectory 1 has 2
    config = TrainConfig(loss="gspo", normalization="sequence", epsilon=0.5)
    loss, _ = policy_loss(new, -log_r, adv, unit, config, StepTotals(6, 2), proximal_logprobs=-log_r)
    g = grad_of(loss, new)
    assert g[:4].tolist() == pytest.approx([-math.exp(0.1) / 4 / 2] * 4)  # one mean over all 4 tokens
    assert g[4:].tolist() == pytest.approx([-math.exp(0.3) / 2 / 2] * 2)
    assert TrainConfig(loss="gspo").normalization == "sequence" and TrainConfig(loss="gspo").epsilon == 3e-4
    assert TrainConfig(loss="cispo").epsilon == 1.0 and TrainConfig(loss="cispo").clip_high == 4.0


def test_truncated_importance_sampling_caps_the_sampler_weight() -> None:
    new = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    sampled = torch.tensor([-3.0, float("nan")], dtype=torch.float64)  # sampler far less likely; unknown
    adv = torch.ones(2, dtype=torch.float64)
    config = TrainConfig(truncated_importance_sampling=2.0)
    loss, sums = policy_loss(new, sampled, adv, torch.tensor([0, 1]), config, StepTotals(2, 2))
    g = grad_of(loss, new)
    assert g.tolist() == pytest.approx([-2.0 / 2, -1.0 / 2])  # weight min(e^3, 2) = 2; unknown: weight 1
    assert sums["clipped"] == 0 and sums["truncated"] == 1


def test_one_cap_under_two_names() -> None:
    """TIS and the async correction are one setting: either name sets it, both must agree, None is ART's unset."""
    assert TrainConfig(off_policy_cap=3.0).truncated_importance_sampling == 3.0
    assert TrainConfig(truncated_importance_sampling=3.0).off_policy_cap == 3.0
    assert TrainConfig(truncated_importance_sampling=None).truncated_importance_sampling == 2.0
    assert TrainConfig(off_policy_cap=3.0, truncated_importance_sampling=3.0).off_policy_cap == 3.0
    with pytest.raises(ValueError, match="one setting"):
        TrainConfig(off_policy_cap=3.0, truncated_importance_sampling=4.0)


@pytest.mark.parametrize("variant", ["grpo", "gspo", "cispo"])
def test_fresh_and_stale_tokens_get_one_loss(variant: str) -> None:
    """Async training: the loss is the same formula whatever version sampled a token, so a step on fresh rollouts
    is the synchronous step bit for bit; a token's correction depends on its sampler gap alone, capped."""
    lengths = [4, 4]
    new, adv, index = batch(lengths, seed=3)
    gen = torch.Generator().manual_seed(7)
    sampled = new.detach() + torch.randn(8, generator=gen, dtype=torch.float64) * 0.8  # far from the trainer
    config, totals = TrainConfig(loss=variant, off_policy_cap=2.0), StepTotals(8, 2)
    sync, _ = policy_loss(new, sampled, adv, index, config, totals)
    sync_grad = grad_of(sync, new)
    for staleness in (torch.zeros(8), torch.tensor([0, 0, 0, 0, 2, 2, 2, 2], dtype=torch.float64)):
        loss, sums = policy_loss(new, sampled, adv, index, config, totals, staleness=staleness)
        assert torch.equal(loss, sync) and torch.equal(grad_of(loss, new), sync_grad)
        assert sums["stale"] == float((staleness > 0).sum()) and sums["staleness"] == float(staleness.sum())
    weight = torch.clamp(torch.exp(new.detach() - sampled), max=2.0)
    per = 4 * 2 if variant == "gspo" else 8  # sequence normalization for gspo
    assert torch.allclose(sync_grad, -adv * weight / per, atol=1e-12)


def test_a_fresh_token_the_sampler_found_less_likely_still_trains() -> None:
    """A fresh token with sampler ratio 1.5 and A > 0 is not clipped away (its gap is a weight, as a stale one's)."""
    new = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    sampled = torch.full((2,), -math.log(1.5), dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    for staleness in (torch.zeros(2), torch.ones(2)):
        loss, _ = policy_loss(
            new, sampled, adv, torch.arange(2), TrainConfig(), StepTotals(2, 2), staleness=staleness
        )
        assert grad_of(loss, new).tolist() == pytest.approx([-1.5 / 2] * 2)
