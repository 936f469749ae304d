"""A batch's common prefix run once (training/shared_prefix.py) gives the plain forward's logprobs and gradients, on
the tiny model through the PEFT trainer; short prefixes, one row and gradient checkpointing take the plain path."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from art_adapters.config import LoRAConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.shared_prefix import MIN_SHARED_TOKENS, common_prefix, decoder_hidden, exact_for
from art_adapters.training.trainer import Trainer

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(tiny_model_path(), LoRAConfig(rank=8, alpha=16), engine="peft")


def batch(prefix: int, suffixes: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Rows sharing `prefix` random ids, then `suffixes[b]` ids of their own; targets inside the prefix (its
    last position included), at its first free position, and at the end."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 700) for _ in range(prefix)]
    rows = [shared + [rng.randrange(3, 700) for _ in range(n)] for n in suffixes]
    targets = [[prefix // 2, prefix - 1, prefix, len(row) - 1] for row in rows]
    return rows, targets


def scored(trainer: Trainer, rows: list[list[int]], targets: list[list[int]], share: bool) -> tuple[Any, Any]:
    trainer.scorer.share_prefix = share
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    logprobs = trainer._token_logprobs(rows, targets, [0.7] * len(rows))
    (logprobs * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.scorer.share_prefix = True
    return logprobs.detach(), grads


def test_the_trainer_shares_on_peft_without_checkpointing(trainer: Trainer) -> None:
    assert trainer.scorer.share_prefix
    checkpointed = Trainer(
        tiny_model_path(), LoRAConfig(rank=8, alpha=16), engine="peft", gradient_checkpointing=True
    )
    assert not checkpointed.scorer.share_prefix


@pytest.mark.parametrize("suffixes", [[5, 40, 17], [1, 1], [30, 2, 2, 9]])
def test_shared_prefix_gives_the_plain_forwards_logprobs_and_gradients(
    trainer: Trainer, suffixes: list[int]
) -> None:
    rows, targets = batch(120, suffixes)
    plain, plain_grads = scored(trainer, rows, targets, share=False)
    shared, shared_grads = scored(trainer, rows, targets, share=True)
    assert torch.allclose(shared, plain, atol=1e-5), (shared - plain).abs().max()
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():  # fp32 sums in another order: equal to a relative 1e-5
        assert (shared_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_the_prefix_runs_once_and_short_prefixes_or_one_row_run_plain(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = trainer.model.get_base_model().get_decoder()
    calls: list[tuple[int, int]] = []
    forward = decoder.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", counted)
    for prefix, suffixes, expected in [
        (120, [5, 9], [(1, 120), (2, 9)]),  # the prefix once, then each row's rest (padded to the longest)
        (MIN_SHARED_TOKENS - 1, [5, 9], [(2, MIN_SHARED_TOKENS + 8)]),
        (120, [9], [(1, 129)]),
    ]:
        calls.clear()
        rows, targets = batch(prefix, suffixes)
        with torch.no_grad():
            trainer._token_logprobs(rows, targets, [1.0] * len(rows))
        assert calls == expected, (prefix, suffixes)


def test_common_prefix_counts_leading_equal_positions_and_leaves_one() -> None:
    assert common_prefix(torch.tensor([[1, 2, 3, 4], [1, 2, 9, 4]])) == 2
    assert common_prefix(torch.tensor([[1, 2, 3], [1, 2, 3]])) == 2
    assert common_prefix(torch.tensor([[5, 2], [1, 2]])) == 0


def test_a_cache_without_per_layer_tensors_falls_back_to_the_plain_forward() -> None:
    class Output:
        def __init__(self, ids: torch.Tensor, cache: Any) -> None:
            self.last_hidden_state = ids[..., None].float()
            self.past_key_values = cache

    class Decoder:
        training = False
        config = SimpleNamespace(attention_dropout=0.0)

        def __init__(self) -> None:
            self.calls: list[bool] = []

        def __call__(self, input_ids: torch.Tensor, use_cache: bool, **_: Any) -> Output:
            self.calls.append(use_cache)
            return Output(input_ids, object())  # a cache of some other kind (a hybrid model's state)

    decoder = Decoder()
    ids = torch.tensor([[7] * 40 + [1], [7] * 40 + [2]])
    hidden = decoder_hidden(decoder, ids, share=True)
    assert decoder.calls == [True, False] and torch.equal(hidden[..., 0], ids.float())


@pytest.mark.parametrize(
    "settings, exact",
    [
        ({}, True),
        ({"attention_dropout": 0.1}, False),
        ({"resid_pdrop": 0.1}, False),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, False),
        ({"rope_scaling": {"type": "longrope"}}, False),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, True),
        ({"layer_types": ["full_attention", "sliding_attention"]}, True),
        ({"layer_types": ["linear_attention", "full_attention"]}, False),
    ],
)
def test_exact_for_refuses_what_one_prefix_cannot_reproduce(settings: dict[str, Any], exact: bool) -> None:
    assert exact_for(SimpleNamespace(**{"attention_dropout": 0.0, **settings})) is exact
    assert exact_for(SimpleNamespace(**settings), lora_dropout=0.05) is False
