"""A trainer that fits, on the tiny model (CPU, fp32): chunked logprobs equal unchunked ones and never hold a
whole [T, V]; gradient checkpointing gives the same gradients; one sequence length (Unsloth's max_seq_length, the
step's limit, over-long trajectories skipped whole and counted); 4-bit only where it can be honoured."""

from __future__ import annotations

import logging
import re
import sys
import types
from typing import Any

import pytest
import torch

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training import loading
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.train

HEAD = LoRAConfig(
    rank=8, alpha=16, modules_to_save=["lm_head"]
)  # the head trains too: its gradient is checked


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


@pytest.fixture(scope="module")
def chunked(model_path) -> Trainer:
    return Trainer(model_path, HEAD, engine="peft", logprob_chunk_tokens=7)


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within 1e-6 of the tensor's scale (its largest magnitude, at least 1): the head's gradients reach
    about 40 here, where fp32's own spacing is 4e-6, so a bare 1e-6 would ask for more than fp32 holds."""
    return bool((a - b).abs().max() <= 1e-6 * max(float(b.abs().max()), 1.0))


def groups_of(trainer: Trainer, completions: list[list[int]], rewards: list[float]) -> list[TrajectoryGroup]:
    messages = [{"role": "user", "content": "Name a number."}]
    prompt = chat_template_ids(trainer.tokenizer, messages, None)
    trajectories = [
        Trajectory(
            llm_calls=[
                LLMCall(
                    request={"messages": messages},
                    prompt_token_ids=prompt,
                    completion_token_ids=ids,
                    logprobs=[-1.5] * len(ids),
                    logprobs_mode="processed_logprobs",
                )
            ],
            reward=reward,
        )
        for ids, reward in zip(completions, rewards, strict=True)
    ]
    return [TrajectoryGroup(trajectories)]


# --- chunked logprobs ----------------------------------------------------------------------------------------------


def test_chunked_logprobs_and_gradients_equal_unchunked(chunked: Trainer) -> None:
    """Two rows of different lengths, two temperatures, 37 trained positions: every chunk size (3 and 7 leave a last
    chunk of 1 and 2 rows; 16; one above 37) gives the unchunked values and LoRA/head gradients within 1e-6, and
    the head really runs chunk by chunk (forward, then once more per chunk in backward)."""
    gen = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(3, 700, (30,), generator=gen).tolist(),
        torch.randint(3, 700, (12,), generator=gen).tolist(),
    ]
    targets = [list(range(4, 30)), list(range(1, 12))]
    positions = sum(len(t) for t in targets)
    weights = torch.randn(positions, generator=gen)
    head_calls = [0]
    head = chunked.model.get_base_model().get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda *_: head_calls.__setitem__(0, head_calls[0] + 1))
    chunked.model.train()
    results = {}
    try:
        for chunk in (None, 3, 7, 16, 1000):
            chunked.scorer.chunk_tokens = chunk
            chunked.model.zero_grad(set_to_none=True)
            head_calls[0] = 0
            values = chunked._token_logprobs(rows, targets, [0.7, 1.3])
            (values * weights).sum().backward()
            results[chunk] = (values.detach(), grads(chunked), head_calls[0])
    finally:
        hook.remove()
        chunked.scorer.chunk_tokens = 7
    base, base_grads, calls = results[None]
    assert calls == 1 and base.shape == (positions,)
    for chunk in (3, 7, 16, 1000):
        values, chunk_grads, calls = results[chunk]
        pieces = -(-positions // chunk)
        assert calls == (1 if pieces == 1 else 2 * pieces), chunk
        assert close(values, base), (chunk, (values - base).abs().max())
        for name, grad in base_grads.items():
            assert close(chunk_grads[name], grad), (chunk, name, (chunk_grads[name] - grad).abs().max())


def test_chunked_logprobs_never_save_a_whole_positions_by_vocabulary_tensor(chunked: Trainer) -> None:
    """What autograd keeps for backward: unchunked, fp32 logits of every trained position; chunked, nothing with
    more than one chunk's rows of vocabulary width (backward recomputes them)."""
    vocab = chunked.model.get_base_model().config.vocab_size
    row = list(range(3, 203))
    targets = [list(range(1, 200))]

    def saved_vocab_rows(chunk: int | None) -> int:
        widest = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal widest
            if tensor.dim() >= 2 and tensor.shape[-1] == vocab:
                widest = max(widest, tensor.numel() // vocab)
            return tensor

        chunked.scorer.chunk_tokens = chunk
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                chunked._token_logprobs([row], targets, [1.0]).sum().backward()
        finally:
            chunked.scorer.chunk_tokens = 7
            chunked.model.zero_grad(set_to_none=True)
        return widest

    assert saved_vocab_rows(None) == 199
    assert saved_vocab_rows(7) == 0  # checkpointed chunks: only their inputs (hidden states) are kept


def test_logprob_chunk_tokens_is_checked_before_loading(model_path) -> None:
    for bad in (-1, 2.5, "64"):
        with pytest.raises(ValueError, match="logprob_chunk_tokens"):
            Trainer(model_path, engine="peft", logprob_chunk_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_seq_len"):
        Trainer(model_path, engine="peft", max_seq_len=0)


# --- gradient checkpointing ------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_the_same_gradients(model_path, capfd) -> None:
    """torch's non-reentrant checkpointing under PEFT: every layer recomputes its forward in backward, every LoRA
    weight gets its gradient (within 1e-6 of the plain run), and transformers has nothing to warn about."""
    results = {}
    for checkpointing in (False, True):
        trainer = Trainer(model_path, HEAD, engine="peft", gradient_checkpointing=checkpointing)
        groups = groups_of(trainer, [[40, 41, 42, 763], [50, 51, 763], [60, 763]], [1.0, 0.0, 0.5])
        layer = trainer.model.get_base_model().get_decoder().layers[0]
        calls: list[int] = []
        layer.register_forward_pre_hook(lambda *_, seen=calls: seen.append(1))
        metrics = trainer.compute_gradients(groups, TrainConfig(micro_batch_tokens=100_000))
        assert metrics["micro_batches"] == 1
        results[checkpointing] = (grads(trainer), len(calls), metrics["loss"])
    plain, plain_calls, plain_loss = results[False]
    checked, checked_calls, checked_loss = results[True]
    assert (plain_calls, checked_calls) == (1, 2)
    assert checked_loss == pytest.approx(plain_loss, abs=1e-6)
    assert plain.keys() == checked.keys()
    # Every lora_B and the head get a gradient (lora_A's is zero while lora_B starts at zero: PEFT's init).
    assert all(g.abs().sum() > 0 for name, g in checked.items() if "lora_A" not in name)
    for name, grad in plain.items():
        assert close(checked[name], grad), (name, (checked[name] - grad).abs().max())
    assert "use_cache" not in capfd.readouterr().err


# --- one sequence length -------------------------------------------------------------------------------------------


class FakeUnsloth:
    """A stand-in `unsloth` module: records what the trainer asks of Unsloth's loader, loads the tiny model with
    transformers + PEFT, or refuses (`fail`)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: dict[str, Any] = {}
        self.peft: dict[str, Any] = {}

    def module(self) -> types.ModuleType:
        fake = self

        class FastLanguageModel:
            @staticmethod
            def from_pretrained(**kwargs: Any) -> tuple[Any, Any]:
                fake.loaded = kwargs
                if fake.fail:
                    raise RuntimeError("no bitsandbytes here")
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(kwargs["model_name"], dtype=kwargs["dtype"])
                return model, loading.load_tokenizer(kwargs["model_name"])

            @staticmethod
            def get_peft_model(model: Any, **kwargs: Any) -> Any:
                from peft import LoraConfig, get_peft_model

                fake.peft = kwargs
                settings = {
                    k: v for k, v in kwargs.items() if k not in ("use_gradient_checkpointing", "random_state")
                }
                return get_peft_model(model, LoraConfig(**settings, task_type="CAUSAL_LM"))

        module = types.ModuleType("unsloth")
        module.FastLanguageModel = FastLanguageModel  # type: ignore[attr-defined]
        return module


def test_max_seq_len_and_checkpointing_reach_unsloths_loader(model_path, monkeypatch) -> None:
    fake = FakeUnsloth()
    monkeypatch.setitem(sys.modules, "unsloth", fake.module())
    trainer = Trainer(model_path, HEAD, engine="unsloth", max_seq_len=96, gradient_checkpointing=True)
    assert trainer.engine == "unsloth" and trainer.max_seq_len == 96
    assert fake.loaded["max_seq_length"] == 96 and fake.loaded["load_in_4bit"] is False
    assert fake.peft["use_gradient_checkpointing"] == "unsloth"
    # Nothing longer than what Unsloth was loaded for ever reaches its decoder (it would cut the row).
    decoder_calls = [0]
    trainer.model.get_base_model().get_decoder().register_forward_pre_hook(
        lambda *_: decoder_calls.__setitem__(0, decoder_calls[0] + 1)
    )
    assert len(trainer.logprobs_of(list(range(3, 99)))) == 95 and decoder_calls[0] == 1
    with pytest.raises(ValueError, match="97 tokens is longer than the trainer's max_seq_len=96"):
        trainer.logprobs_of(list(range(3, 100)))
    assert decoder_calls[0] == 1


def test_load_in_4bit_reaches_unsloth_and_is_refused_where_it_cannot_be_honoured(
    model_path, monkeypatch
) -> None:
    fake = FakeUnsloth()
    monkeypatch.setitem(sys.modules, "unsloth", fake.module())
    loading.load_unsloth(str(model_path), HEAD, torch.float32, 512, False, 0, load_in_4bit=True)
    assert fake.loaded["load_in_4bit"] is True and fake.peft["use_gradient_checkpointing"] is False
    fake.loaded = {}
    for engine, device in (("peft", "cpu"), ("unsloth", "cpu"), ("peft", "cuda")):
        with pytest.raises(ValueError, match="load_in_4bit needs Unsloth on a CUDA device"):
            Trainer(model_path, engine=engine, device=device, dtype=torch.float32, load_in_4bit=True)
    assert fake.loaded == {}  # refused before anything loads
    # Unsloth failing to load 4-bit is an error, never a silent fall back to a full-precision PEFT base.
    monkeypatch.setitem(sys.modules, "unsloth", FakeUnsloth(fail=True).module())
    with pytest.raises(RuntimeError, match="could not load the 4-bit base: no bitsandbytes here"):
        Trainer(model_path, engine="unsloth", device="cuda", dtype=torch.float32, load_in_4bit=True)


def test_over_long_trajectories_are_skipped_counted_and_named(model_path, caplog) -> None:
    trainer = Trainer(model_path, HEAD, engine="peft", max_seq_len=48)
    prompt_len = len(groups_of(trainer, [[1]], [0.0])[0].trajectories[0].llm_calls[0].prompt_token_ids)
    fits, over = 48 - prompt_len, 49 - prompt_len  # completions that end exactly at / one past the limit
    groups = groups_of(trainer, [[40] * fits, [41] * over, [42] * 3, [43] * (over + 5)], [1.0, 0.0, 0.5, 0.2])
    # The config asks for more than the trainer was loaded for: the trainer's limit wins.
    config = TrainConfig(max_seq_len=4096, learning_rate=1e-3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with caplog.at_level(logging.WARNING, logger="art_adapters.training.trainer"):
        metrics = trainer.train_step(groups, config)
    warnings = [r.getMessage() for r in caplog.records if "max_seq_len" in r.getMessage()]
    assert warnings == [
        "2 of 4 trajectories trained nothing this step: 2 trajectory(ies) are longer than max_seq_len (skipped "
        f"whole, never truncated) (max_seq_len=48: trajectory 1 of group 0 ({prompt_len + over} tokens), "
        f"trajectory 3 of group 0 ({prompt_len + over + 5} tokens))"
    ]
    assert metrics["skipped_too_long"] == 2 and metrics["skipped_trajectories"] == 2
    assert metrics["trained_tokens"] == fits + 3 and "skipped_reason" not in metrics
    assert trainer.step == 1
    # A step of over-long trajectories only: skipped, reported, and the step still advances (weights untouched).
    caplog.clear()
    after_first = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(after_first[n], before[n]) for n in before)
    only_long = groups_of(trainer, [[41] * over, [43] * (over + 5)], [1.0, 0.0])
    metrics = trainer.train_step(only_long, TrainConfig())
    assert metrics["skipped_too_long"] == 2 and "longer than max_seq_len" in metrics["skipped_reason"]
    assert "no sampled token ids" not in metrics["skipped_reason"]
    assert trainer.step == 2 and metrics["step"] == 2
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, after_first[name]), name
    # A config asking for less than the trainer's limit: the config's limit.
    sequences, metrics = trainer.prepare(
        groups_of(trainer, [[40] * fits], [1.0]), TrainConfig(max_seq_len=47)
    )
    assert sequences == [] and metrics["skipped_too_long"] == 1


def test_sft_skips_over_long_trajectories_too(model_path, caplog) -> None:
    from art_adapters.config import SFTConfig

    trainer = Trainer(model_path, HEAD, engine="peft", max_seq_len=48)
    hi = {"role": "user", "content": "hi"}
    short = Trajectory(messages_and_choices=[hi, {"role": "assistant", "content": "yo"}])
    long = Trajectory(messages_and_choices=[hi, {"role": "assistant", "content": "word " * 40}])
    with caplog.at_level(logging.WARNING, logger="art_adapters.training.trainer"):
        metrics = trainer.sft_step([short, long], SFTConfig(max_seq_len=4096))
    assert metrics["skipped_too_long"] == 1 and metrics["sequences"] == 1 and "skipped_reason" not in metrics
    warnings = [r.getMessage() for r in caplog.records if "max_seq_len" in r.getMessage()]
    assert len(warnings) == 1
    assert re.fullmatch(
        r"SFT: longer than max_seq_len=48, skipped: trajectory 1 \((\d+) tokens\)", warnings[0]
    )
    metrics = trainer.sft_step([long], SFTConfig())
    assert metrics["skipped_reason"] == "no assistant tokens within max_seq_len=48"
