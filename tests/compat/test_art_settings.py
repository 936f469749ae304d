"""ART's training settings do in art-adapters what they do in ART (issue 37): `allow_training_without_logprobs`
trains assistant turns that carry no logprobs, `grad_accumulation_sequences` (several optimizer updates per step in
ART) is refused, and `logprob_calculation_chunk_size`, which only sizes ART's buffers, changes nothing."""

from __future__ import annotations

import pydantic
import pytest

import art_adapters as art
from art_adapters.compat import train_config
from art_adapters.tiny import tiny_model_path
from art_adapters.training.trainer import Trainer
from compat.test_art_training import RecordingBackend, groups


def plain_groups() -> list[art.TrajectoryGroup]:
    """ART-style trajectories whose assistant turns are plain messages (no Choice, no logprobs)."""
    return [
        art.TrajectoryGroup(
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "Say a colour."},
                    {"role": "assistant", "content": answer},
                ],
                reward=reward,
            )
            for answer, reward in (("red", 1.0), ("a colour", 0.0))
        )
    ]


def test_allow_training_without_logprobs_is_train_retokenized_text() -> None:
    assert train_config(
        None, art.dev.TrainConfig(allow_training_without_logprobs=True)
    ).train_retokenized_text
    assert not train_config(
        None, art.dev.TrainConfig(allow_training_without_logprobs=False)
    ).train_retokenized_text


async def test_both_training_styles_pass_allow_training_without_logprobs(tmp_path) -> None:
    backend = RecordingBackend(tmp_path)
    model = art.TrainableModel(name="agent", project="compat", base_model="tiny")
    await model.register(backend)
    await model.train(groups(), _config=art.dev.TrainConfig(allow_training_without_logprobs=True))
    assert backend.steps[-1][0].train_retokenized_text
    await backend.train(model, groups(), allow_training_without_logprobs=True)
    assert backend.steps[-1][0].train_retokenized_text
    await backend.train(model, groups(), logprob_calculation_chunk_size=128)
    assert backend.steps[-1][0] == art.TrainConfig(loss="cispo")  # buffer size only: the same step


@pytest.mark.train
def test_art_code_that_allows_training_without_logprobs_trains_its_plain_turns() -> None:
    """The trainer itself: ART's setting trains the re-rendered assistant turns (without it, nothing trains)."""
    trainer = Trainer(tiny_model_path(), art.LoRAConfig(rank=4, alpha=8), engine="peft")
    skipped = trainer.train_step(plain_groups(), train_config(None, {}))
    assert skipped["trained_tokens"] == 0 and "skipped_reason" in skipped
    config = train_config(None, art.dev.TrainConfig(allow_training_without_logprobs=True))
    metrics = trainer.train_step(plain_groups(), config)
    assert metrics["trained_tokens"] > 0 and "skipped_reason" not in metrics
    assert metrics["sampled_token_fraction"] == 0.0  # re-rendered text, and the certificate says so
    assert metrics["step"] == 2


@pytest.mark.parametrize("value", [1, 8])
async def test_grad_accumulation_sequences_is_refused_wherever_it_is_given(tmp_path, value: int) -> None:
    """ART takes an optimizer update every N sequences (several per step); a step here is one update."""
    with pytest.raises(pydantic.ValidationError, match="grad_accumulation_sequences"):
        art.TrainConfig(grad_accumulation_sequences=value)
    with pytest.raises(art.UnsupportedARTSetting, match="one optimizer update per step"):
        train_config(None, {"grad_accumulation_sequences": value})
    backend = RecordingBackend(tmp_path)
    model = art.TrainableModel(name="agent", project="compat", base_model="tiny")
    await model.register(backend)
    with pytest.raises(art.UnsupportedARTSetting, match="grad_accumulation_sequences"):
        await backend.train(model, groups(), grad_accumulation_sequences=value)
    assert not backend.steps  # refused before anything ran
    assert art.TrainConfig(grad_accumulation_sequences=None).grad_accumulation_sequences is None
