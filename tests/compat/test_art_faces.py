"""ART's smaller faces, used by its examples: `art.types`, `art.costs`, `art.utils.litellm`, prompted models named
`org/model`, `LocalBackend(path=None)`, and strip_logprobs's warning in ART's words."""

from __future__ import annotations

import json
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


ART_EXAMPLE_IMPORTS = {
    "art_adapters.local.backend": ["LocalBackend"],
    "art_adapters.utils.get_repo_root_path": ["get_repo_root_path"],
    "art_adapters.utils.logging": ["_C", "_ts", "dim", "err", "info", "ok", "step", "warn"],
    "art_adapters.utils.sft": ["train_sft_from_file", "create_sft_dataset_iterator", "iterate_file"],
    "art_adapters.utils.deploy_model": ["deploy_model", "LoRADeploymentJob", "LoRADeploymentProvider"],
    "art_adapters.utils.deployment.together": ["TogetherDeploymentConfig", "TogetherJobStatus"],
    "art_adapters.utils.deployment.wandb": ["deploy_wandb"],
    "art_adapters.utils.deployment.common": ["DeploymentResult"],
    "art_adapters.utils.s3": ["pull_model_from_s3", "push_model_to_s3", "archive_and_presign_step_url"],
    "art_adapters.utils.s3_checkpoint_utils": ["get_latest_checkpoint_step_from_s3"],
    "art_adapters.guided_completion": ["get_guided_completion_params"],
    "art_adapters.trajectories": ["MetadataValue"],
}


@pytest.mark.parametrize("module", sorted(ART_EXAMPLE_IMPORTS))
def test_the_paths_arts_examples_import_exist(module: str) -> None:
    import importlib

    loaded = importlib.import_module(module)
    for name in ART_EXAMPLE_IMPORTS[module]:
        assert getattr(loaded, name) is not None, f"{module}.{name}"
    from art_adapters.local.backend import LocalBackend

    assert LocalBackend is art.LocalBackend


def test_repo_root_and_nice_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from art_adapters.utils.get_repo_root_path import get_repo_root_path
    from art_adapters.utils.logging import _C, ok, warn

    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "examples").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "examples")
    assert get_repo_root_path() == str(tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    assert get_repo_root_path() == "."
    ok("trained")
    warn("slow")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"{_C.GREEN}OK   {_C.RESET} trained") and f"{_C.YELLOW}WARN" in out[1]


def write_chats(path: Path, n: int) -> None:
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")


def test_sft_schedule_and_file_streaming(tmp_path: Path) -> None:
    from art_adapters.utils.sft import create_lr_schedule, get_file_row_count, iterate_file

    assert create_lr_schedule(5, 1.0, "linear", warmup_steps=1) == [
        1.0,
        1.0,
        0.6666666666666667,
        0.33333333333333337,
        0.0,
    ]
    assert create_lr_schedule(3, 2.0, "constant", warmup_steps=2) == [1.0, 2.0, 2.0]
    cosine = create_lr_schedule(3, 1.0, "cosine", min_lr=0.1)
    assert cosine[0] == 1.0 and abs(cosine[1] - 0.55) < 1e-9 and abs(cosine[2] - 0.1) < 1e-9
    with pytest.raises(ValueError, match="Unknown method"):
        create_lr_schedule(3, 1.0, "step")  # type: ignore[arg-type]

    data = tmp_path / "chats.jsonl"
    write_chats(data, 7)
    assert get_file_row_count(str(data)) == 7
    first = [t.messages()[0]["content"] for t in iterate_file(str(data), epochs=2, shuffle_buffer_size=3)]
    assert len(first) == 14 and sorted(first[:7]) == sorted(first[7:]) == [f"q{i}" for i in range(7)]
    assert first != [f"q{i}" for i in range(7)] * 2  # shuffled
    again = [t.messages()[0]["content"] for t in iterate_file(str(data), 2, 3, initial_skip=5)]
    assert again == first[5:]  # the same order, resumed
    with pytest.raises(ValueError, match="Only JSONL"):
        get_file_row_count(str(tmp_path / "chats.json"))
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2: each line needs a 'messages' list"):
        list(iterate_file(str(tmp_path / "bad.jsonl")))


async def test_sft_chunks_and_from_file_share_one_schedule(tmp_path: Path) -> None:
    from art_adapters.utils.sft import create_lr_schedule, create_sft_dataset_iterator, train_sft_from_file

    chats = [art.Trajectory(messages_and_choices=[{"role": "user", "content": str(i)}]) for i in range(9)]
    chunks = list(
        create_sft_dataset_iterator(
            chats, chunk_size=2, epochs=2, batch_size=2, peak_lr=1.0, show_progress=False
        )
    )
    schedule = create_lr_schedule(10, 1.0, "linear", warmup_steps=1)
    assert [c.step for c in chunks] == [0, 2, 4, 5, 7, 9]
    assert [r for c in chunks for r in c.config.learning_rate] == schedule  # type: ignore[union-attr]
    assert sum(len(c.trajectories) for c in chunks) == 18 and chunks[2].trajectories and chunks[3].epoch == 1
    resumed = list(create_sft_dataset_iterator(chats, 2, 2, 2, 1.0, initial_step=4, show_progress=False))
    assert [c.step for c in resumed] == [4, 5, 7, 9]

    class Recorder:
        calls: list[tuple[int, list[float]]] = []

        async def train_sft(
            self, trajectories: object, config: object, _config: object, verbose: bool
        ) -> None:
            self.calls.append((len(list(trajectories)), list(config.learning_rate)))  # type: ignore[attr-defined]

    data = tmp_path / "chats.jsonl"
    write_chats(data, 7)
    model = Recorder()
    await train_sft_from_file(
        model, str(data), epochs=2, batch_size=3, peak_lr=1.0, initial_step=1, final_step=4
    )  # type: ignore[arg-type]
    whole = create_lr_schedule(5, 1.0, "linear", warmup_steps=0)
    assert model.calls == [(9, whole[1:4])]


def test_guided_completion_params_freeze_the_teachers_answer() -> None:
    import jsonschema
    from openai.types.chat import ChatCompletion

    from art_adapters.guided_completion import get_guided_completion_params

    def completion(message: dict[str, object]) -> ChatCompletion:
        return ChatCompletion.model_validate(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "t",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}
                ],
            }
        )

    assert get_guided_completion_params(completion({"content": "Paris"})) == (["Paris"], None, None)
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"}}},
        },
    }
    call = {
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "move", "arguments": '{"to": "A1"}'}}
        ],
    }
    choice, tool_choice, tools = get_guided_completion_params(completion(call), [tool])
    assert choice is None and tool_choice == {"type": "function", "function": {"name": "move"}}
    schema = tools[0]["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate({"to": "A1"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"to": "B2"}, schema)
    assert tool["function"]["parameters"]["properties"]["to"] == {"type": "string"}  # the original untouched
    with pytest.raises(ValueError, match="No base tools"):
        get_guided_completion_params(completion(call))
