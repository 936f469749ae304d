"""Training what you choose: `train_on` masks, per-role advantages and the sampled-token certificate, on the tiny
model's real trainer (PEFT on CPU). The executor's tokens, left out, contribute exactly nothing to the gradient."""

from __future__ import annotations

import math

import pytest
import torch
from openai.types.chat.chat_completion import Choice

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


def two_node_trajectory(
    trainer: Trainer,
    k: int,
    reward: float,
    *,
    lp_shift: float = 0.0,
    planner: art.CallSource = PLANNER,
    executor: art.CallSource | None = EXECUTOR,
) -> Trajectory:
    """A planner call, then an executor call whose prompt extends it (one chained sequence); `executor=None`: a
    rollout that failed before the executor ran (its planner call only)."""
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
            source=planner,
        ),
        LLMCall(
            request={"messages": messages2},
            prompt_token_ids=prompt2,
            completion_token_ids=done_ids,
            logprobs=[-2.0 - 0.01 * i + lp_shift for i in range(len(done_ids))],
            source=executor or EXECUTOR,
        ),
    ]
    return Trajectory(llm_calls=calls if executor is not None else calls[:1], reward=reward)


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
        by_role = {sequence.roles[i][0]: sequence.advantage_at(i) for i in trained}
        assert by_role == pytest.approx({"planner": planner[k], "worker": worker[k]})
    # a role with equal rewards carries no signal, whatever the overall rewards say
    groups = groups_of(trainer, [1.0, 0.0, 0.2])
    for t in groups[0].trajectories:
        t.rewards_by_role = {"planner": 0.3}
    sequences, _ = trainer.prepare(groups, TrainConfig())
    for sequence in sequences:
        planner_tokens = [
            i for i, m in enumerate(sequence.trained_mask) if m and sequence.roles[i][0] == "planner"
        ]
        assert planner_tokens and all(sequence.advantage_at(i) == 0.0 for i in planner_tokens)
        worker_tokens = [
            i for i, m in enumerate(sequence.trained_mask) if m and sequence.roles[i][0] == "worker"
        ]
        assert all(sequence.advantage_at(i) == sequence.advantage != 0.0 for i in worker_tokens)


def test_the_group_baseline_covers_rollouts_that_train_nothing(trainer: Trainer) -> None:
    """Rewards [1, 0.5, 0, 0] where the last two failed before the executor: trained on the executor only, the 0.5
    rollout is still better than its group's mean, so its advantage stays positive (0.302, not -1.0)."""
    rewards = [1.0, 0.5, 0.0, 0.0]
    group = TrajectoryGroup(
        [
            two_node_trajectory(trainer, k, r, executor=EXECUTOR if k < 2 else None)
            for k, r in enumerate(rewards)
        ]
    )
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    expected = [(r - mean) / std for r in rewards]
    for config in (TrainConfig(train_on={"nodes": ["executor"]}), TrainConfig()):
        sequences, metrics = trainer.prepare([group], config)
        trained = {s.trajectory_index: s.advantage for s in sequences}
        if config.train_on:
            assert sorted(trained) == [0, 1] and metrics["skipped_trajectories"] == 2
        assert trained == pytest.approx({i: expected[i] for i in trained})
    assert expected[1] == pytest.approx(0.3015, abs=1e-4)


def test_role_rewards_and_train_on_match_a_subgraph_node_alike(
    trainer: Trainer, caplog: pytest.LogCaptureFixture
) -> None:
    """A node inside a subgraph (`research/planner`) answers to "planner" in `train_on` roles and in
    `rewards_by_role` alike; a key that matches no call is warned about, not silently ignored."""
    nested = art.CallSource(framework="langgraph", node="planner", checkpoint_ns="research:1|planner:2")
    assert nested.node_path == "research/planner" and nested.role_names() == ("research/planner", "planner")
    group = TrajectoryGroup(
        [two_node_trajectory(trainer, k, 1.0, planner=nested) for k in range(3)]  # overall rewards equal
    )
    for t, r in zip(group.trajectories, [1.0, 0.0, 0.5], strict=True):
        t.rewards_by_role = {"planner": r}
    sequences, metrics = trainer.prepare([group], TrainConfig(train_on={"roles": ["planner"]}))
    assert len(sequences) == 3 and metrics["left_out_tokens"] > 0
    mean, std = 0.5, math.sqrt((0.25 + 0.25 + 0.0) / 3)
    for k, sequence in enumerate(sequences):
        trained = [i for i, m in enumerate(sequence.trained_mask) if m]
        assert trained and all(sequence.roles[i] == ("research/planner", "planner") for i in trained)
        want = ([1.0, 0.0, 0.5][k] - mean) / std
        assert all(sequence.advantage_at(i) == pytest.approx(want) for i in trained)
    with caplog.at_level("WARNING", logger="art_adapters.training.trainer"):
        for t in group.trajectories:
            t.rewards_by_role = {"planer": 1.0}
        trainer.prepare([group], TrainConfig(train_on={"nodes": ["executer"]}))
    (warning,) = [r.getMessage() for r in caplog.records if "match no captured call" in r.getMessage()]
    assert "['executer']" in warning and "['planer']" in warning


def test_certificate_sampled_token_fraction(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    groups = groups_of(trainer, [1.0, 0.0])
    metrics = trainer.compute_gradients(groups, TrainConfig())
    trainer.optimizer.zero_grad(set_to_none=True)
    assert metrics["sampled_token_fraction"] == 1.0 and metrics["captured_token_fraction"] == 1.0
    assert all(t.metrics["sampled_token_fraction"] == 1.0 for t in groups[0].trajectories)

    # ids a rollout supplies in a Choice (ART's hand-built way) are trusted as sampled, and the certificate tells
    # them from ids our transport recorded from the engine's answer
    supplied = []
    for reward, t in zip((1.0, 0.0), groups_of(trainer, [1.0, 0.0])[0].trajectories, strict=True):
        call = t.llm_calls[0]
        choice = Choice.model_validate(
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "plan"},
                "prompt_token_ids": call.prompt_token_ids,
                "token_ids": call.completion_token_ids,
            }
        )
        supplied.append(Trajectory(messages_and_choices=[*call.request_messages(), choice], reward=reward))
    metrics = trainer.compute_gradients([TrajectoryGroup(supplied)], TrainConfig())
    trainer.optimizer.zero_grad(set_to_none=True)
    assert metrics["sampled_token_fraction"] == 1.0 and metrics["captured_token_fraction"] == 0.0
    assert metrics["ratio_missing_tokens"] == metrics["trained_tokens"] > 0  # no logprobs supplied: counted

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
        out[0].origin = "text"
        return out

    monkeypatch.setattr("art_adapters.training.tokenize.samples_of", buggy)
    with pytest.raises(TokenizationError, match="sampled_token_fraction"):
        trainer.compute_gradients(groups_of(trainer, [1.0, 0.0]), TrainConfig())


def test_train_on_is_validated() -> None:
    with pytest.raises(ValueError, match="train_on"):
        TrainConfig(train_on={"nodes": []})
    with pytest.raises(ValueError):
        TrainConfig(train_on={"graphs": ["x"]})  # type: ignore[dict-item]
