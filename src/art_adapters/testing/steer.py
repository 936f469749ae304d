"""Make a random tiny model say a given text through the real engine: a structured-output `choice` plus a logit
bias towards the text's canonical tokens (longer ones preferred where the grammar allows several)."""

from __future__ import annotations

from typing import Any


def steer(tokenizer: Any, text: str, eos: str = "<|im_end|>") -> dict[str, Any]:
    """Request options (`extra_body`) under which vLLM samples `text` + `eos` as the ids `tokenizer` encodes."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids(eos)]
    bias = {str(t): min(90, 40 + 5 * len(tokenizer.decode([t]))) for t in ids}
    return {"structured_outputs": {"choice": [text]}, "logit_bias": bias}
