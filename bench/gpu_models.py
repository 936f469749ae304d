"""The shapes bench/gpu_check.py runs (Qwen2.5-7B and -3B from their public configs; tiny ones for the CPU dry
run), each built with random weights straight onto the device, and a GRPO step's worth of token-id trajectories."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art_adapters.tiny import MODEL_KWARGS, tiny_model_path
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

QWEN_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "use_cache": False,  # the public configs say true: only generation reads it, and the trainer never caches
}
# The public config.json values of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen2.5-3B-Instruct.
QWEN25_7B = QWEN_COMMON | {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
QWEN25_3B = QWEN_COMMON | {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_window_layers": 70,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
TINY = QWEN_COMMON | dict(
    MODEL_KWARGS, vocab_size=1024, max_position_embeddings=2048, bos_token_id=None, eos_token_id=None
)


@dataclass(frozen=True)
class Case:
    """A model shape on a card: `card_gib` None means the GPU's own memory (the plan's card size otherwise);
    `capped` makes a card of that size out of the GPU (every process capped, a ballast holding the rest)."""

    config: dict[str, Any]
    card_gib: float | None
    capped: bool
    capability: tuple[int, int] | None  # None: the GPU's own
    sequences: int
    prompt_tokens: int
    completion_tokens: int
    max_seq_len: int


CASES = {
    "qwen2.5-7b": Case(QWEN25_7B, None, False, None, 8, 512, 3072, 4096),
    # A 24 GB card (RTX 4090, L4, A10G class) reports about 23.6 GiB; Ada's capability.
    "qwen2.5-3b-24gb": Case(QWEN25_3B, 23.6, True, (8, 9), 8, 512, 3072, 4096),
}
# The same sequence on the CPU (`--dry-run`): tiny shapes, short rows, the plan's GiB allocated as MiB.
DRY_CASES = {
    "qwen2.5-7b": Case(TINY, 79.2, False, (9, 0), 8, 24, 40, 128),
    "qwen2.5-3b-24gb": Case(TINY | {"tie_word_embeddings": True}, 23.6, True, (8, 9), 8, 24, 40, 128),
}


# --- the model: a real shape, random weights, nothing on disk but config.json and a tokenizer ---------------------


def model_folder(config: dict[str, Any], work: Path) -> Path:
    """config.json (the shape) and the tiny byte tokenizer (its ids < 768 spell text; the trajectories here are
    token ids, so the tokenizer only pads): no weights."""
    folder = work / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in tiny_model_path().iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, folder / file.name)
    return folder


@contextlib.contextmanager
def random_weights(device: torch.device) -> Iterator[None]:
    """While the trainer loads: transformers' `from_pretrained` builds the model from the folder's config.json,
    randomly initialized directly on `device` (15 GB of 7B weights are never written or read). The rest of the
    trainer's loading (dtype, checkpointing, PEFT) is the library's own. Restored on exit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    own = vars(AutoModelForCausalLM).get("from_pretrained")

    def build(cls: type, path: str | Path, *args: Any, **kwargs: Any) -> Any:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)

    AutoModelForCausalLM.from_pretrained = classmethod(build)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        if own is not None:
            AutoModelForCausalLM.from_pretrained = own  # type: ignore[method-assign]
        else:
            del AutoModelForCausalLM.from_pretrained


def groups_for(case: Case, vocab: int) -> list[TrajectoryGroup]:
    """One group of `case.sequences` trajectories of random token ids (prompt + sampled completion), rewards all
    different; the sampled logprobs are a uniform policy's (what a random model gives, about -ln(vocab))."""
    generator = torch.Generator().manual_seed(0)
    length = case.prompt_tokens + case.completion_tokens
    logprob = -float(torch.log(torch.tensor(float(vocab))))
    trajectories = []
    for i in range(case.sequences):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        call = LLMCall(
            request={"messages": [{"role": "user", "content": f"task {i}"}], "temperature": 1.0},
            prompt_token_ids=ids[: case.prompt_tokens],
            completion_token_ids=ids[case.prompt_tokens :],
            logprobs=[logprob] * case.completion_tokens,
            logprobs_mode="processed_logprobs",
        )
        trajectories.append(Trajectory(llm_calls=[call], reward=i / max(case.sequences - 1, 1)))
    return [TrajectoryGroup(trajectories)]
