"""The decoder's hidden states for a right-padded batch whose rows start alike (an agent's system prompt and tool
schemas): the common prefix runs once, its keys and values are shared by every row, and only the rest runs per
row. Exact (the same attention, positions and gradients), so a step's result does not depend on it."""

from __future__ import annotations

from typing import Any

import torch

# Below this many shared tokens the second decoder call costs more than the prefix saves.
MIN_SHARED_TOKENS = 32


def common_prefix(input_ids: torch.Tensor) -> int:
    """How many leading positions every row of `input_ids` ([B, W]) has alike, at most W - 1 (one position is
    always left to run per row)."""
    same = (input_ids == input_ids[:1]).all(dim=0)
    return min(int(same.long().cumprod(0).sum()), input_ids.shape[1] - 1)


def decoder_hidden(decoder: Any, input_ids: torch.Tensor, share: bool) -> torch.Tensor:
    """`decoder(input_ids).last_hidden_state`; with `share`, a batch of two or more rows whose common prefix is at
    least MIN_SHARED_TOKENS runs that prefix once (batch 1) and the rest of each row on its keys and values.

    Not for gradient checkpointing (transformers turns the cache off under it) nor for a model whose cache is
    not per-layer keys and values: those, and short prefixes, take the plain forward."""
    checkpointed = getattr(decoder, "gradient_checkpointing", False) and decoder.training
    shared = common_prefix(input_ids) if share and input_ids.shape[0] > 1 and not checkpointed else 0
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
