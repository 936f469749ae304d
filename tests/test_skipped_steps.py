"""A step that trains nothing says so (issue 37): no `sampled_token_fraction = 1.0` over zero tokens, the skipped
trajectories counted by why, one summary warning per step instead of one per trajectory, and the step advances."""

from __future__ import annotations

import logging

import pytest

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(tiny_model_path(), LoRAConfig(rank=4, alpha=8), engine="peft")


def plain(n: int) -> list[Trajectory]:
    """ART-style trajectories whose answers are plain assistant messages: no sampled token ids."""
    return [
        Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": f"x{i}"},
            ],
            reward=float(i % 2),
        )
        for i in range(n)
    ]


def captured(trainer: Trainer, n: int) -> list[Trajectory]:
    messages = [{"role": "user", "content": "count"}]
    prompt = chat_template_ids(trainer.tokenizer, messages, None)
    return [
        Trajectory(
            llm_calls=[
                LLMCall(
                    request={"messages": messages},
                    prompt_token_ids=prompt,
                    completion_token_ids=[40 + i, 41 + i, 42],
                    logprobs=[-1.0, -1.0, -1.0],
                    logprobs_mode="processed_logprobs",
                )
            ],
            reward=float(i % 2),
        )
        for i in range(n)
    ]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("art_adapters.training")
    ]


def test_a_step_that_trains_nothing_certifies_nothing_and_still_advances(
    trainer: Trainer, caplog: pytest.LogCaptureFixture
) -> None:
    step = trainer.step
    with caplog.at_level(logging.INFO):
        metrics = trainer.train_step([TrajectoryGroup(plain(4)), TrajectoryGroup(plain(4))], TrainConfig())
    assert metrics["trained_tokens"] == 0 and metrics["sampled_token_fraction"] == 0.0
    assert metrics["captured_token_fraction"] == 0.0
    assert metrics["skipped_trajectories"] == metrics["skipped_no_sampled_ids"] == 8
    assert "2 group(s) have no sampled token ids" in metrics["skipped_reason"]
    assert metrics["step"] == trainer.step == step + 1  # ART's rule: a skipped step still advances
    # no warning per trajectory: the backend reports the step's `skipped_reason` once (LocalBackend's warning)
    assert warnings_of(caplog) == []


def test_equal_rewards_train_nothing_and_certify_nothing(trainer: Trainer) -> None:
    trajectories = captured(trainer, 2)
    for t in trajectories:
        t.reward = 1.0
    metrics = trainer.train_step([TrajectoryGroup(trajectories)], TrainConfig())
    assert metrics["trained_tokens"] == 0 and metrics["skipped_groups"] == 1
    assert metrics["sampled_token_fraction"] == 0.0


def test_a_step_that_skips_some_trajectories_warns_once_with_the_counts(
    trainer: Trainer, caplog: pytest.LogCaptureFixture
) -> None:
    long = captured(trainer, 2)
    for t in long:  # a prompt longer than max_seq_len: skipped whole, never truncated
        t.llm_calls[0].prompt_token_ids = [5] * 64
    groups = [
        TrajectoryGroup([*captured(trainer, 2), *plain(3)]),
        TrajectoryGroup(long),
        TrajectoryGroup(plain(2)),
    ]
    with caplog.at_level(logging.INFO):
        metrics = trainer.train_step(groups, TrainConfig(max_seq_len=32))
    assert metrics["trained_tokens"] > 0 and metrics["sampled_token_fraction"] == 1.0
    assert metrics["skipped_trajectories"] == 7
    assert metrics["skipped_no_sampled_ids"] == 5 and metrics["skipped_too_long"] == 2
    (warning,) = warnings_of(caplog)
    assert warning.startswith("7 of 9 trajectories trained nothing this step")
    assert "5 trajectory(ies) have no sampled token ids" in warning
    assert "2 trajectory(ies) are longer than max_seq_len (skipped whole, never truncated)" in warning
    assert "trajectory 0 of group 1 (" in warning  # named, with its length
