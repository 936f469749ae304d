"""Versions are checked where training happens (issue 37): the real PEFT trainer on the tiny model refuses tokens
from a policy version it has not produced (the pipeline's `FutureVersionError`), and a Choice that carries only
ART's `policy_token_spans` gets each token's version from its spans in the step's staleness metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.pipeline import FutureVersionError as PipelineFutureVersionError
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer
from art_adapters.training.versions import FutureVersionError, span_versions
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup
from compat.test_art_training import RecordingBackend
from test_remote_backend import running

pytestmark = pytest.mark.train

MESSAGES = [{"role": "user", "content": "count"}]


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(tiny_model_path(), LoRAConfig(rank=4, alpha=8), engine="peft")


def call(trainer: Trainer, completion: list[int], version: int | None) -> LLMCall:
    return LLMCall(
        request={"messages": MESSAGES},
        prompt_token_ids=chat_template_ids(trainer.tokenizer, MESSAGES, None),
        completion_token_ids=completion,
        logprobs=[-1.0] * len(completion),
        logprobs_mode="processed_logprobs",
        policy_version=version,
    )


def art_choice(trainer: Trainer, completion: list[int], spans: list[dict[str, Any]]) -> Choice:
    """A Choice as ART's clients record it: token ids, logprobs and only `policy_token_spans` (no version)."""
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "1 2 3"},
            "logprobs": {
                "content": [
                    {"token": f"token_id:{t}", "logprob": -1.0, "bytes": [], "top_logprobs": []}
                    for t in completion
                ]
            },
            "prompt_token_ids": chat_template_ids(trainer.tokenizer, MESSAGES, None),
            "token_ids": completion,
            "policy_token_spans": spans,
        }
    )


def span(start: int, end: int, version: int) -> dict[str, Any]:
    return {
        "start_token": start,
        "end_token": end,
        "policy_version": version,
        "lora_slot": f"agent@{version}",
        "update_seq": version,
    }


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def assert_unchanged(trainer: Trainer, before: dict[str, torch.Tensor]) -> None:
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name]), name


def test_the_pipeline_and_the_trainer_raise_one_error() -> None:
    assert PipelineFutureVersionError is FutureVersionError


def test_tokens_from_a_future_version_are_refused_before_any_update(trainer: Trainer) -> None:
    trainer.step = 2
    before = weights(trainer)
    future = [Trajectory(llm_calls=[call(trainer, [40, 41, 42], 3)], reward=r) for r in (0.0, 1.0)]
    with pytest.raises(
        FutureVersionError, match="policy version 3, but the newest version this trainer has trained is 2"
    ):
        trainer.train_step([TrajectoryGroup(future)], TrainConfig())
    assert trainer.step == 2
    assert_unchanged(trainer, before)

    # ART's form: only spans, one of them from the future
    spans = [span(0, 2, 1), span(2, 3, 5)]
    choices = [
        Trajectory(
            messages_and_choices=[*MESSAGES, art_choice(trainer, [40, 41, 42 + i], spans)], reward=float(i)
        )
        for i in range(2)
    ]
    with pytest.raises(FutureVersionError, match="policy version 5"):
        trainer.train_step([TrajectoryGroup(choices)], TrainConfig())
    # a trajectory whose final_policy_version is ahead, as the pipeline refuses it
    stamped = [
        Trajectory(llm_calls=[call(trainer, [40, 41 + i], None)], reward=float(i), final_policy_version=4)
        for i in range(2)
    ]
    with pytest.raises(FutureVersionError, match="policy version 4"):
        trainer.train_step([TrajectoryGroup(stamped)], TrainConfig())
    assert trainer.step == 2
    assert_unchanged(trainer, before)
    current = [Trajectory(llm_calls=[call(trainer, [40, 41 + i], 2)], reward=float(i)) for i in range(2)]
    assert (
        trainer.train_step([TrajectoryGroup(current)], TrainConfig())["trained_tokens"] > 0
    )  # the present trains


def test_a_spans_only_choice_dates_each_token_by_its_span(trainer: Trainer) -> None:
    """Four sampled tokens at trainer step 4: two sampled by version 1 (3 steps stale), two by version 4 (fresh)."""
    trainer.step = 4
    spans = [span(0, 2, 1), span(2, 4, 4)]
    trajectories = [
        Trajectory(
            messages_and_choices=[*MESSAGES, art_choice(trainer, [40 + i, 41, 42, 43], spans)],
            reward=float(i),
        )
        for i in range(2)
    ]
    metrics = trainer.train_step([TrajectoryGroup(trajectories)], TrainConfig())
    assert metrics["trained_tokens"] == 8
    assert metrics["stale_tokens"] == 4
    assert metrics["token_steps_off_policy"] == pytest.approx((4 * 3 + 4 * 0) / 8)


def test_span_versions_reads_arts_half_open_intervals() -> None:
    assert span_versions([span(0, 2, 1), span(3, 4, 2)], 5) == [1, 1, None, 2, None]
    assert span_versions(None, 3) is None and span_versions([], 3) is None
    with pytest.raises(ValueError, match="integer policy_version"):
        span_versions([{"start_token": 0, "end_token": 1}], 2)
    with pytest.raises(ValueError, match="non-empty interval"):
        span_versions([span(2, 2, 1)], 3)


class TrainerBackend(RecordingBackend):
    """The server's backend protocol over the real trainer (what LocalBackend runs, without an engine)."""

    def __init__(self, path: Path, trainer: Trainer) -> None:
        super().__init__(path)
        self.trainer = trainer

    async def train_events(
        self, model: Any, groups: list[TrajectoryGroup], config: TrainConfig, *, record: bool = True
    ) -> AsyncIterator[dict[str, Any]]:
        yield {"event": "started", "step": self.trainer.step}
        metrics = self.trainer.train_step(groups, config)
        yield {"event": "done", "step": self.trainer.step, "metrics": metrics}


async def test_remote_backend_train_is_refused_by_the_servers_trainer(
    trainer: Trainer, tmp_path: Path
) -> None:
    """ART's `backend.train` through `art-adapters serve`: the server's trainer refuses, the client raises the
    same error (not a generic server failure)."""
    trainer.step = 1
    backend = TrainerBackend(tmp_path, trainer)
    with running(create_app(backend, api_key="key", allowed_base_models=["tiny"])) as url:
        remote = art.RemoteBackend(url, api_key="key")
        model = art.TrainableModel(name="agent", project="versions", base_model="tiny")
        await model.register(remote)
        future = [Trajectory(llm_calls=[call(trainer, [40, 41 + i], 2)], reward=float(i)) for i in range(2)]
        with pytest.raises(FutureVersionError, match="policy version 2, but the newest version this trainer"):
            await remote.train(model, [TrajectoryGroup(future)])
        assert trainer.step == 1
        await remote.close()
