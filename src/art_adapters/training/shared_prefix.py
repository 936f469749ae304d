"""The decoder's hidden states for a right-padded batch whose rows start alike (an agent's system prompt and tool
schemas): the common prefix runs once, its keys and values are shared by every row, and only the rest runs per
row. Exact (the same attention, positions and gradients), so a step's result does not depend on it."""

from __future__ import annotations

from typing import Any

import torch

# Below this many shared tokens the second decoder call costs more than the prefix saves.
MIN_SHARED_TOKENS = 32
# Rotary scalings that depend on the length of the call: the prefix alone would be rotated as a short sequence.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def exact_for(config: Any, lora_dropout: float = 0.0) -> bool:
    """Whether running the prefix once gives the plain forward's result for a model of this config: no dropout (one
    prefix would draw one mask for every row), no length-dependent rotary scaling, and only attention layers
    (a linear-attention or state-space layer's cache is not keys and values)."""
    dropouts = [
        v for k, v in vars(config).items() if k.endswith(("dropout", "pdrop")) and isinstance(v, (int, float))
    ]
    if lora_dropout > 0 or any(v > 0 for v in dropouts):
        return False
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in LENGTH_DEPENDENT_ROPE:
            return False
    layer_types = getattr(config, "layer_types", None) or []
    return all(kind in ATTENTION_LAYERS for kind in layer_types)


def common_prefix(input_ids: torch.Tensor) -> int:
    """How many leading positions every row of `input_ids` ([B, W]) has alike, at most W - 1 (one position is
    always left to run per row)."""
    same = (input_ids == input_ids[:1]).all(dim=0)
    return min(int(same.long().cumprod(0).sum()), input_ids.shape[1] - 1)


def decoder_hidden(decoder: Any, input_ids: torch.Tensor, share: bool) -> torch.Tensor:
    """`decoder(input_ids).last_hidden_state`; with `share`, a batch of two or more rows whose common prefix is at
    least MIN_SHARED_TOKENS runs that prefix once (batch 1) and the rest of each row on its keys and values.

    Not under gradient checkpointing (transformers turns the cache off under it), nor for a model `exact_for`
    refuses, nor where the cache turns out not to be per-layer keys and values: those, and short prefixes, take
    the plain forward. Under no_grad the prefix's keys and values are held until the call returns (the plain
    forward frees each layer's as it goes): for an 8B model, about 0.5 GiB at 4,096 tokens."""
    checkpointed = getattr(decoder, "gradient_checkpointing", False) and decoder.training
    if share and (checkpointed or not exact_for(decoder.config)):
        share = False
    shared = common_prefix(input_ids) if share and input_ids.shape[0] > 1 else 0
    if shared < MIN_SHARED_TOKENS:
        return decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    batch = input_ids.shape[0]
    prefix = decoder(input_ids=input_ids[:1, :shared], use_cache=True)
    cache = prefix.past_key_values
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(x, "keys", None), torch.Tensor) for x in layers):
        return decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    for layer in layers:  # views: backward sums each row's gradient into the one prefix
        layer.keys = layer.keys.expand(batch, *layer.keys.shape[1:])
        layer.values = layer.values.expand(batch, *layer.values.shape[1:])
    rest = decoder(input_ids=input_ids[:, shared:], past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([prefix.last_hidden_state.expand(batch, -1, -1), rest], dim=1)
