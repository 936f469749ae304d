"""Training what you choose: `train_on` masks, per-role advantages and the sampled-token certificate, on the tiny
model's real trainer (PEFT on CPU). The executor's tokens, left out, contribute exactly nothing to the gradient."""

from __future__ import annotations

import math

import pytest
import torch

import art_adapters as art
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training import samples as samples_module
from art_adapters.training.tokenize import TokenizationError, chat_template_ids, tokenize_trajectory
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.train

PLANNER = art.CallSource(framework="langgraph", node="planner", checkpoint_ns="planner:1")
EXECUTOR = art.CallSource(framework="langgraph", node="executor", checkpoint_ns="executor:2", role="worker")


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(tiny_model_path(), LoRAConfig(rank=8, alpha=16), engine="peft")


def two_node_trajectory(trainer: Trainer, k: int, reward: float, *, lp_shift: float = 0.0) -> Trajectory:
    """A planner call, then an executor call whose prompt extends it (one chained sequence)."""
    tok = trainer.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": f"Plan task {k}."}]
    plan = f"step {k}: look it up"
    plan_ids = [*tok.encode(plan, add_special_tokens=False), end]
    prompt1 = chat_template_ids(tok, messages, None)
    messages2 = [*messages, {"role": "assistant", "content": plan}, {"role": "user", "content": "Execute."}]
    prompt2 = chat_template_ids(tok, messages2, None)
    assert prompt2[: len(prompt1) + len(plan_ids)] == prompt1 + plan_ids
    done_ids = [*tok.encode(f"done {k}" * (k + 1), add_special_tokens=False), end]
    calls = [
        LLMCall(
            request={"messages": messages},
            prompt_token_ids=prompt1,
            completion_token_ids=plan_ids,
            logprobs=[-1.0 - 0.01 * i for i in range(len(plan_ids))],
            source=PLANNER,
        ),
        LLMCall(
            request={"messages": messages2},
            prompt_token_ids=prompt2,
            completion_token_ids=done_ids,
            logprobs=[-2.0 - 0.01 * i + lp_shift for i in range(len(done_ids))],
            source=EXECUTOR,
        ),
    ]
    return Trajectory(llm_calls=calls, reward=reward)


def groups_of(trainer: Trainer, rewards: list[float], **kwargs: float) -> list[TrajectoryGroup]:
    return [TrajectoryGroup([two_node_trajectory(trainer, k, r, **kwargs) for k, r in enumerate(rewards)])]


def gradient(trainer: Trainer, groups: list[TrajectoryGroup], config: TrainConfig) -> list[torch.Tensor]:
    metrics = trainer.compute_gradients(groups, config)
    assert "skipped_reason" not in metrics, metrics
    out = [p.grad.detach().clone() for p in trainer.params]
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def test_train_on_masks_every_token_of_calls_not_chosen(trainer: Trainer) -> None:
    trajectory = two_node_trajectory(trainer, 1, 1.0)
    planner_ids, executor_ids = (c.completion_token_ids or [] for c in trajectory.llm_calls)
    for train_on, trained in (
        ({"nodes": ["planner"]}, len(planner_ids)),
        ({"nodes": ["executor"]}, len(executor_ids)),
        ({"roles": ["worker"]}, len(executor_ids)),
        ({"nodes": ["planner"], "roles": ["worker"]}, len(planner_ids) + len(executor_ids)),
        ({"agents": ["nobody"]}, 0),
    ):
        out = tokenize_trajectory(trajectory, trainer.tokenizer, max_seq_len=4096, train_on=train_on)
        assert sum(s.num_trained for s in out.sequences) == trained, train_on
        if trained:
            (sequence,) = out.sequences  # still one chained sequence: left-out calls stay as context
            assert len(sequence) == len(trajectory.llm_calls[1].prompt_token_ids or []) + len(executor_ids)
        else:
            assert out.skipped and "train_on" in out.reason
    out = tokenize_trajectory(
        trajectory, trainer.tokenizer, max_seq_len=4096, train_on={"nodes": ["planner"]}
    )
    assert out.left_out_tokens == len(executor_ids)
    (sequence,) = out.sequences
    tail = sequence.trained_mask[-len(executor_ids) :]
    assert tail == [0] * len(executor_ids)


def test_left_out_tokens_have_exactly_zero_gradient(trainer: Trainer) -> None:
    """Only the planner trains: the executor's sampled logprobs and its role's reward change nothing, to the bit;
    the same change with the executor trained does change the gradient (the test can fail)."""
    config = TrainConfig(train_on={"nodes": ["planner"]})
    base = gradient(trainer, groups_of(trainer, [1.0, 0.0, 0.5]), config)
    perturbed_groups = groups_of(trainer, [1.0, 0.0, 0.5], lp_shift=0.7)
    for t, r in zip(perturbed_groups[0].trajectories, [0.0, 1.0, 0.2], strict=True):
        t.rewards_by_role = {"worker": r}
    perturbed = gradient(trainer, perturbed_groups, config)
    assert all(torch.equal(a, b) for a, b in zip(base, perturbed, strict=True))
    assert any(float(g.abs().sum()) > 0 for g in base)

    everything = TrainConfig()
    full = gradient(trainer, groups_of(trainer, [1.0, 0.0, 0.5]), everything)
    full_perturbed = gradient(trainer, groups_of(trainer, [1.0, 0.0, 0.5], lp_shift=0.7), everything)
    assert not all(torch.equal(a, b) for a, b in zip(full, full_perturbed, strict=True))


def test_per_role_rewards_give_each_role_its_group_advantage(trainer: Trainer) -> None:
    groups = groups_of(trainer, [1.0, 1.0, 1.0])  # overall rewards equal: no overall advantage
    for t, (planner, worker) in zip(
        groups[0].trajectories, [(1.0, 0.0), (0.0, 0.0), (0.5, 1.0)], strict=True
    ):
        t.rewards_by_role = {"planner": planner, "worker": worker}
    sequences, metrics = trainer.prepare(groups, TrainConfig())
    assert metrics["skipped_groups"] == 0 and len(sequences) == 3

    def advantages(rewards: list[float]) -> list[float]:
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        return [(r - mean) / std for r in rewards]

    planner, worker = advantages([1.0, 0.0, 0.5]), advantages([0.0, 0.0, 1.0])
    for k, sequence in enumerate(sequences):
        trained = [i for i, m in enumerate(sequence.trained_mask) if m]
        by_role = {sequence.roles[i]: sequence.advantage_at(i) for i in trained}
        assert by_role == pytest.approx({"planner": planner[k], "worker": worker[k]})
    # a role with equal rewards carries no signal, whatever the overall rewards say
    groups = groups_of(trainer, [1.0, 0.0, 0.2])
    for t in groups[0].trajectories:
        t.rewards_by_role = {"planner": 0.3}
    sequences, _ = trainer.prepare(groups, TrainConfig())
    for sequence in sequences:
        planner_tokens = [
            i for i, m in enumerate(sequence.trained_mask) if m and sequence.roles[i] == "planner"
        ]
        assert planner_tokens and all(sequence.advantage_at(i) == 0.0 for i in planner_tokens)
        worker_tokens = [
            i for i, m in enumerate(sequence.trained_mask) if m and sequence.roles[i] == "worker"
        ]
        assert all(sequence.advantage_at(i) == sequence.advantage != 0.0 for i in worker_tokens)


def test_certificate_sampled_token_fraction(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    groups = groups_of(trainer, [1.0, 0.0])
    metrics = trainer.compute_gradients(groups, TrainConfig())
    trainer.optimizer.zero_grad(set_to_none=True)
    assert metrics["sampled_token_fraction"] == 1.0
    assert all(t.metrics["sampled_token_fraction"] == 1.0 for t in groups[0].trajectories)

    # plain assistant dicts carry no sampled ids: never trained unless asked; asked, the certificate says so
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    plain = [Trajectory(messages_and_choices=messages, reward=r) for r in (1.0, 0.0)]
    mixed = [TrajectoryGroup([*groups_of(trainer, [1.0, 0.0])[0].trajectories]), TrajectoryGroup(plain)]
    metrics = trainer.compute_gradients(mixed, TrainConfig())
    assert metrics["sampled_token_fraction"] == 1.0 and metrics["groups_without_samples"] == 1
    metrics = trainer.compute_gradients(mixed, TrainConfig(train_retokenized_text=True))
    trainer.optimizer.zero_grad(set_to_none=True)
    assert metrics["sampled_token_fraction"] == 0.0
    assert all(t.metrics["sampled_token_fraction"] == 0.0 for t in plain)

    # a (simulated) bug that marks a re-rendered sample trained is refused without the opt-in
    real = samples_module.samples_of

    def buggy(*args: object, **kwargs: object) -> list[samples_module.Sample]:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        out[0].sampled = False
        return out

    monkeypatch.setattr("art_adapters.training.tokenize.samples_of", buggy)
    with pytest.raises(TokenizationError, match="sampled_token_fraction"):
        trainer.compute_gradients(groups_of(trainer, [1.0, 0.0]), TrainConfig())


def test_train_on_is_validated() -> None:
    with pytest.raises(ValueError, match="train_on"):
        TrainConfig(train_on={"nodes": []})
    with pytest.raises(ValueError):
        TrainConfig(train_on={"graphs": ["x"]})  # type: ignore[dict-item]
