"""The offline tiny model: deterministic build, tokenizer round trip, Hermes chat template, loads in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_adapters.tiny import build_tiny_model, tiny_model_path, weights_digest
from fixtures_vllm import WEATHER_TOOLS as TOOLS

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21C sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "25C cloudy"},
    {"role": "assistant", "content": "Paris 21C, Rome 25C."},
    {"role": "user", "content": "Thanks! Ünïcödé 日本語 🙂"},
]
TEXTS = [
    "Hello world",
    "  leading spaces\n\n\ttabs 12345 3.14",
    "Ünïcödé 日本語 🙂 café",
    "<|im_start|>user\nhi<|im_end|>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "it's don't I'LL",
]


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(base / "a"), build_tiny_model(base / "b")


def test_build_is_deterministic(two_builds: tuple[Path, Path]) -> None:
    a, b = two_builds
    assert weights_digest(a) == weights_digest(b)
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert weights_digest(a) == weights_digest(tiny_model_path())
    with pytest.raises(FileExistsError):
        build_tiny_model(a)


def test_config_and_tokenizer_shape(two_builds: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    a, _ = two_builds
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["head_dim"] == 32
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32 and cfg["num_key_value_heads"] == 2
    tok = AutoTokenizer.from_pretrained(a)
    assert 512 <= len(tok) <= 1024 and len(tok) == cfg["vocab_size"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ["<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    gen = json.loads((a / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def _ids(tok: object, conversation: list[dict[str, object]]) -> list[int]:
    return tok.apply_chat_template(  # type: ignore[attr-defined]
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_save_load_round_trip(two_builds: tuple[Path, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    a, _ = two_builds
    raw = Tokenizer.from_file(str(a / "tokenizer.json"))
    first = AutoTokenizer.from_pretrained(a)
    first.save_pretrained(tmp_path / "saved")
    second = AutoTokenizer.from_pretrained(tmp_path / "saved")
    generic = PreTrainedTokenizerFast.from_pretrained(a)
    for text in TEXTS + [first.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)]:
        ids = raw.encode(text).ids
        for tok in (first, second, generic):
            assert tok.encode(text, add_special_tokens=False) == ids, (type(tok), text)
            assert tok.decode(ids) == text
    assert _ids(first, CONVERSATION) == _ids(second, CONVERSATION) == _ids(generic, CONVERSATION)


def test_template_hermes_form(two_builds: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(two_builds[0])
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert (
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n21C sunny\n</tool_response>\n<tool_response>\n25C cloudy" in text
    )
    assert text.endswith("<|im_start|>user\nThanks! Ünïcödé 日本語 🙂<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
    tools_only = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False)
    assert tools_only.startswith("<|im_start|>system\n# Tools\n") and "<tools>\n{" in tools_only


def test_loads_and_runs_in_transformers(two_builds: tuple[Path, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = two_builds[0]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([_ids(tok, CONVERSATION)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] >= ids.shape[1] + 1


def test_cli_without_a_folder_prints_the_shared_model() -> None:
    """`--base-model "$(art-adapters tiny-model)"` (as the examples' docstrings show): stdout is the path alone."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "art_adapters.cli", "tiny-model"], capture_output=True, text=True, check=True
    )
    assert result.stdout == f"{tiny_model_path()}\n"
    assert result.stderr == ""


def test_cli_refuses_a_folder_that_is_not_a_tiny_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "notes.txt").write_text("mine")
    result = subprocess.run(
        [sys.executable, "-m", "art_adapters.cli", "tiny-model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "is not empty and is not a tiny model" in result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
