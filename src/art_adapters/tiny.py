"""Deterministic, offline tiny Qwen2/Qwen3-architecture models: our byte-level tokenizer or Qwen's real one.

Used by tests, benchmarks and the demo, where no model hub is reachable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TINY_MODEL_VERSION = "v2"
FINAL_NORM_GAIN = 6.0
# A token's best reachable logit grows with the gain, the others' log-sum-exp with ln(vocab): at gain 6 one token of
# Qwen's 151k could not pass p ~ 0.9 (its format never sampled whole); 12 gives it the room 6 gives 768 tokens.
FAMILY_GAIN = {"byte": FINAL_NORM_GAIN, "qwen2.5": 12.0, "qwen3": 12.0}

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS: list[str] = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# byte: our own 768-token byte-level BPE (fast to learn on); qwen2.5 / qwen3: Qwen's real 151k vocabulary, added
# tokens and chat formats (qwen_vocab.py, qwen_templates.py), on the Qwen2 / Qwen3 architecture.
FAMILIES: tuple[str, ...] = ("byte", "qwen2.5", "qwen3")
VOCAB_SIZE = 768  # tokenizer size target (bytes + merges + added tokens); the model rows equal it

# Qwen2's pre-tokenization regex, so that a loader that rebuilds a Qwen2 pre-tokenizer gets the same one.
_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

MODEL_KWARGS: dict[str, object] = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}

# Qwen2.5 / Hermes style. Tool-call arguments may be a dict or an already-encoded JSON string (OpenAI form).
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- elif not message.content %}{{- '\\n' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_CORPUS_PARTS: list[str] = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "You are a helpful assistant. Answer the question briefly and correctly. Think step by step.",
    "The user asked for the weather in Paris, London, Tokyo, Berlin, Madrid, Rome and New York.",
    "What is the capital of France? The capital of France is Paris. What is two plus two? It is four.",
    "Please call the search tool with a query, then read the results and give the final answer.",
    "The agent plans, acts, observes and reflects. Reward is given when the task is solved.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14 -1 +7 = 12 * 3 / 4 % 5.",
    "Yes. No. Maybe. Correct! Wrong? Done: the answer is 7. Guess a number between 1 and 100.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "import json\nresult = json.loads(text)\nif result is None:\n    raise ValueError('empty')\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "arguments": {"query": "capital of France"}}',
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
    '"required": ["expression"]}}}',
    "The temperature is 21 degrees and sunny. Tomorrow it will rain in the morning and clear up later.",
    "Reinforcement learning trains a policy from rewards. Each trajectory is scored and compared in a group.",
    "Hello! How can I help you today? Thank you, that is all. Goodbye and have a nice day.",
    "System prompt, user message, assistant reply, tool call, tool response, final answer.",
]


def _corpus() -> list[str]:
    lines: list[str] = []
    for rep in range(3):
        for part in _CORPUS_PARTS:
            lines.append(part if rep == 0 else part.lower() if rep == 1 else part.upper())
    return lines


def build_tokenizer_object() -> Tokenizer:
    """Train the byte-level BPE tokenizer (deterministic: fixed corpus, fixed settings)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def _write_tokenizer(out: Path, tok: Tokenizer, added: list[tuple[str, bool]], chat_template: str) -> int:
    """Save `tok` with a tokenizer_config.json naming its added tokens (and which are special) and the template."""
    tok.save(str(out / "tokenizer.json"))
    specials = [content for content, special in added if special and content != PAD_TOKEN]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tok.token_to_id(content)): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in added
        },
        "additional_special_tokens": specials,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": int(MODEL_KWARGS["max_position_embeddings"]),  # type: ignore[arg-type]
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "padding_side": "right",
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": specials}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)


def _save_tokenizer(out: Path, family: str) -> int:
    if family == "byte":
        added = [(t, True) for t in SPECIAL_TOKENS] + [(t, False) for t in TOOL_TOKENS]
        return _write_tokenizer(out, build_tokenizer_object(), added, CHAT_TEMPLATE)
    from .qwen_templates import CHAT_TEMPLATES
    from .qwen_vocab import ADDED_TOKENS, build_qwen_tokenizer

    return _write_tokenizer(out, build_qwen_tokenizer(family), ADDED_TOKENS[family], CHAT_TEMPLATES[family])


def _save_model(out: Path, *, seed: int, vocab_size: int, tok_ids: dict[str, int], family: str) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    arch = "Qwen3" if family == "qwen3" else "Qwen2"
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=vocab_size,
        bos_token_id=tok_ids[PAD_TOKEN],
        eos_token_id=tok_ids[EOS_TOKEN],
        pad_token_id=tok_ids[PAD_TOKEN],
        torch_dtype="float32",
        **MODEL_KWARGS,
    )
    config.architectures = [f"{arch}ForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    from .training.quiet import quiet_import_notes

    with quiet_import_notes():  # the model class imports transformers' integrations (torchao's notes)
        model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.float32)
    std = float(config.initializer_range)
    with torch.no_grad():  # explicit init, independent of transformers' init order and global RNG
        for name, p in sorted(model.named_parameters()):
            if name == "model.norm.weight":
                # A random head over a unit-norm state caps logits near ±2.5, so LoRA (the head frozen) could
                # not make any token likely. A larger final-norm gain gives the logits room (RL can learn).
                p.fill_(FAMILY_GAIN[family])
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    from .training.quiet import quiet_loading

    with quiet_loading():  # a one-shard write needs no progress line
        model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tok_ids[PAD_TOKEN],
        eos_token_id=[tok_ids[EOS_TOKEN], tok_ids[PAD_TOKEN]],
        pad_token_id=tok_ids[PAD_TOKEN],
    ).save_pretrained(str(out))


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny-model family {family!r}; choose one of {', '.join(FAMILIES)}")


def build_tiny_model(
    out_dir: str | Path, *, seed: int = 0, overwrite: bool = False, family: str = "byte"
) -> Path:
    """Build the tiny model + tokenizer of `family` into ``out_dir`` (Hugging Face layout) and return the path."""
    _check_family(family)
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(out, family)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: int(tok.token_to_id(t)) for t in (PAD_TOKEN, EOS_TOKEN)}
    _save_model(out, seed=seed, vocab_size=vocab_size, tok_ids=ids, family=family)
    meta = {"version": TINY_MODEL_VERSION, "seed": seed, "vocab_size": vocab_size}
    if family != "byte":  # the byte model's marker file stays as it was (cached builds compare equal)
        meta["family"] = family
    (out / "art_tiny_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def tiny_model_path(family: str = "byte") -> Path:
    """Build once into a cache dir and return it (env ``ART_ADAPTERS_TINY_MODEL`` overrides the byte model's)."""
    _check_family(family)
    env = os.environ.get("ART_ADAPTERS_TINY_MODEL") if family == "byte" else None
    name = f"tiny-model-{TINY_MODEL_VERSION}" if family == "byte" else f"tiny-model-{family}-v2"
    target = (Path(env).expanduser() if env else Path.home() / ".cache" / "art-adapters" / name).resolve()
    if (target / "art_tiny_model.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_tiny_model(tmp, overwrite=True, family=family)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)  # atomic; fails if a concurrent build won the race
        except OSError:
            if not (target / "art_tiny_model.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def weights_digest(model_dir: str | Path) -> str:
    """SHA-256 over the tensors (names, shapes, bytes) of a saved model, independent of file metadata."""
    from safetensors.numpy import load_file

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in sorted(tensors):
            arr = tensors[name]
            h.update(f"{name}:{arr.dtype}:{arr.shape}".encode())
            h.update(arr.tobytes())
    return h.hexdigest()


def tiny_model_command(out_dir: str | None, family: str = "byte") -> None:
    """CLI entry: ``art-adapters tiny-model [OUT_DIR] [--family F]`` prints the model's path. Without OUT_DIR: the
    shared cache (built once). With it: builds there (rebuilds a previous tiny model, never other folders)."""
    if out_dir is None:
        print(tiny_model_path(family))
        return
    out = Path(out_dir).expanduser()
    previous = (out / "art_tiny_model.json").exists()
    if out.exists() and any(out.iterdir()) and not previous:
        raise SystemExit(f"{out} exists, is not empty and is not a tiny model; choose another folder")
    print(build_tiny_model(out, overwrite=previous, family=family))
