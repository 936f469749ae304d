"""Where running the prefix once would not be exact, the trainer and `decoder_hidden` take the plain forward: LoRA
dropout (one prefix would draw one mask for every row) and rotary scalings that depend on the call's length."""

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


def _rope_config(kind: str) -> object:
    from transformers import AutoConfig

    small = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0}
    small |= {"eos_token_id": 1, "bos_token_id": 2}
    if kind == "dynamic":  # dynamic NTK: the rotary base depends on the longest position in the call
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        return AutoConfig.for_model("llama", max_position_embeddings=64, rope_parameters=rope, **small)
    # Phi-3/Phi-4-mini's longrope: short or long factors by the call's length against the original window
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
    }
    rope["original_max_position_embeddings"] = 64
    return AutoConfig.for_model(
        "phi3",
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=rope,
        **small,
    )


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_length_dependent_rope_gives_the_plain_forwards_hidden_states(kind: str) -> None:
    """A prefix inside the original window, the rows past it: the prefix alone is rotated as a short sequence."""
    from transformers import AutoModelForCausalLM

    from art_adapters.training.shared_prefix import decoder_hidden

    torch.manual_seed(0)
    decoder = AutoModelForCausalLM.from_config(_rope_config(kind)).float().get_decoder().eval()
    prefix = torch.randint(3, 299, (1, 50))
    ids = torch.cat([prefix.expand(3, -1), torch.randint(3, 299, (3, 50))], 1)  # 100 tokens > 64
    with torch.no_grad():
        plain, shared = decoder_hidden(decoder, ids, False), decoder_hidden(decoder, ids, True)
    assert torch.allclose(shared, plain, atol=1e-4), (shared - plain).abs().max()
