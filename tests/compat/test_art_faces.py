"""ART's smaller faces, used by its examples: `art.types`, `art.costs`, `art.utils.litellm`, prompted models named
`org/model`, `LocalBackend(path=None)`, and strip_logprobs's warning in ART's words."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import art_adapters as art


def test_types_face_names_the_same_classes() -> None:
    from art_adapters import types

    assert types.TrainConfig is art.TrainConfig
    assert types.Messages is art.Messages and types.MessagesAndChoices is art.MessagesAndChoices
    assert types.Verbosity.__args__ == (0, 1, 2)


def test_cost_calculator_prices_calls_per_split() -> None:
    from art_adapters.costs import ModelPricing, build_cost_calculator, compute_train_cost

    model = art.TrainableModel(name="m", project="p", base_model="b")
    assert model.cost_calculator(100, 50, "train") == {}  # no pricing, no cost
    pricing = ModelPricing(prefill=1.0, sample=4.0, train=2.0)
    model.set_cost_calculator(build_cost_calculator(pricing))
    costs = model.cost_calculator(1_000_000, 500_000, "val")
    assert costs == {"costs/val/prefill": 1.0, "costs/val/sample": 2.0}
    assert model.cost_calculator(None, 1, "/train/")["costs/train/prefill"] == 0.0
    with pytest.raises(ValueError, match="cost_context"):
        model.cost_calculator(1, 1, "")
    assert compute_train_cost(3_000_000, pricing) == 6.0
    model.set_cost_calculator(None)
    assert model.cost_calculator(1, 1, "train") == {}


def test_litellm_choice_becomes_an_openai_choice_that_trains() -> None:
    litellm = pytest.importorskip("litellm")
    from art_adapters.utils.litellm import convert_litellm_choice_to_openai

    response = litellm.ModelResponse(
        choices=[
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "look", "arguments": "{}"}}],
                },
                "logprobs": {
                    "content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]
                },
            }
        ]
    )
    choice = convert_litellm_choice_to_openai(response.choices[0])
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and choice.message.tool_calls[0].function.name == "look"
    assert choice.logprobs is not None and choice.logprobs.content[0].logprob == -0.5
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice], reward=1.0)
    assert trajectory.messages()[-1]["tool_calls"][0]["function"]["name"] == "look"
    plain = convert_litellm_choice_to_openai({"message": {"content": "ok"}})
    assert plain.message.role == "assistant" and plain.finish_reason == "stop" and plain.logprobs is None


def test_prompted_models_may_be_named_org_slash_model(tmp_path: Path) -> None:
    from art_adapters.backend.local import LocalBackend

    judge = art.Model(name="openai/o4-mini", project="p")
    backend = LocalBackend(path=tmp_path)
    assert backend.model_dir(judge) == tmp_path / "p" / "models" / "openai" / "o4-mini"
    for bad in ["../x", "a/../../b", "a//b", "/abs", "a/b/c/d/e"]:
        with pytest.raises(ValueError, match="model name"):
            art.Model(name=bad, project="p")
    with pytest.raises(ValueError, match="must match"):  # a trained model's name is one folder
        art.TrainableModel(name="org/m", project="p", base_model="b")


def test_local_backend_path_none_is_arts_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from art_adapters.backend.local import LocalBackend

    monkeypatch.chdir(tmp_path)
    assert LocalBackend(path=None).path == tmp_path / ".art"


def test_strip_logprobs_warns_in_arts_words(caplog: pytest.LogCaptureFixture) -> None:
    from art_adapters.utils import strip_logprobs

    class Uncopyable:
        def __deepcopy__(self, memo: object) -> object:
            raise TypeError("no copies")

    thing = Uncopyable()
    with caplog.at_level(logging.WARNING):
        assert strip_logprobs(thing) is thing
    assert "Failed to deepcopy object in strip_logprobs: no copies. Returning original object unchanged." in (
        caplog.text
    )
