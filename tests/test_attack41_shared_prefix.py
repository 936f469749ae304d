"""Attack probe on training/shared_prefix.py: with LoRA dropout on, the shared prefix runs once, so every row's
prefix positions get one dropout mask (the plain forward draws one per row): not the plain forward's step."""

from __future__ import annotations

import random

import pytest
import torch

from art_adapters.config import LoRAConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.trainer import Trainer

pytestmark = pytest.mark.train


def test_lora_dropout_gives_each_rows_prefix_its_own_noise() -> None:
    trainer = Trainer(tiny_model_path(), LoRAConfig(rank=8, alpha=16, dropout=0.5), engine="peft")
    with torch.no_grad():  # a non-zero LoRA B, so the adapter (and its dropout) changes the forward
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 700) for _ in range(100)]
    rows = [prefix + [rng.randrange(3, 700) for _ in range(5)] for _ in range(2)]
    targets = [[50, 99], [50, 99]]  # the same prefix positions in both rows
    trainer.model.train()
    torch.manual_seed(0)
    logprobs = trainer._token_logprobs(rows, targets, [1.0, 1.0]).detach()
    # the plain forward: independent dropout per row, so the two rows' prefix logprobs differ
    assert not torch.allclose(logprobs[:2], logprobs[2:]), "both rows' prefix got the same dropout mask"
