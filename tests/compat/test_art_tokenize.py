"""ART's tokenization API as a port calls it (ART PRs #773 and #782), rewritten after ART's own tests
(tests/unit/trajectories/test_tokenize.py, test_tokenized_models.py): `Trajectory.tokenize()`,
`TrajectoryGroup.tokenize()`, `art.trajectories.LegacyHistory(...).tokenize()`, `TokenFlag`, and a history whose
later prompt re-tokenizes the sampled text (`reconcile_text_equivalent_tokenizations`)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import art_adapters as art
from art_adapters.qwen_templates import QWEN3_CHAT_TEMPLATE
from art_adapters.tiny import tiny_model_path
from art_adapters.training.render import chat_template_ids
from art_adapters.trajectories import LegacyHistory

EXACT, SAMPLED = art.TokenFlag.EXACT, art.TokenFlag.SAMPLED
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path())


def prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return chat_template_ids(tokenizer, messages, None)


def byte_by_byte(tokenizer: Any, text: str) -> list[int]:
    """A tokenization of `text` the model may sample but the tokenizer would not produce: one piece per char."""
    return [i for c in text for i in tokenizer.encode(c, add_special_tokens=False)]


def call(prompt_ids: list[int], completion: list[int], logprob: float = -0.5) -> art.LLMCall:
    return art.LLMCall(
        request={"model": "policy", "messages": HI},
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion,
        logprobs=[logprob] * len(completion),
        logprobs_mode="processed_logprobs",
    )


def test_token_flags_are_arts() -> None:
    assert (int(EXACT), int(SAMPLED)) == (1, 2) and EXACT | SAMPLED == 3


def test_trajectory_tokenize_flags_the_engines_prompt_and_sampled_tokens(tokenizer: Any) -> None:
    p = prompt(tokenizer, HI)
    answer = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    trajectory = art.Trajectory(
        llm_calls=[call(p, answer)], reward=0.5, metrics={"turns": 1}, metadata={"id": "a"}
    )
    tokenized = trajectory.tokenize(tokenizer=tokenizer)
    assert isinstance(tokenized, art.TokenizedTrajectory)
    assert tokenized.token_ids == p + answer == tokenized.tokens and tokenized.model == "policy"
    assert tokenized.flags == [EXACT] * len(p) + [EXACT | SAMPLED] * len(answer)
    assert all(math.isnan(x) for x in tokenized.logprobs[: len(p)]) and tokenized.logprobs[len(p) :] == [
        -0.5
    ] * len(answer)
    assert (tokenized.reward, tokenized.metrics, tokenized.metadata) == (0.5, {"turns": 1}, {"id": "a"})
    # ART's other way to name the tokenizer: the base model to load it from
    assert (
        trajectory.tokenize(base_model=str(tiny_model_path()), model="mine").token_ids == tokenized.token_ids
    )
    with pytest.raises(ValueError, match="tokenizer= or base_model="):
        trajectory.tokenize()


def test_group_tokenize_keeps_the_groups_data_and_round_trips_nan(tokenizer: Any) -> None:
    p = prompt(tokenizer, HI)
    group = art.TrajectoryGroup(
        [
            art.Trajectory(llm_calls=[call(p, [40 + i, tokenizer.eos_token_id])], reward=float(i))
            for i in range(2)
        ],
        metadata={"scenario": 3},
    )
    tokenized = group.tokenize(tokenizer=tokenizer)
    assert [t.reward for t in tokenized.trajectories] == [0.0, 1.0] and tokenized.metadata == {"scenario": 3}
    payload = tokenized.model_dump_json()
    assert '"NaN"' in payload
    restored = art.TokenizedTrajectoryGroup[art.TokenizedTrajectory].model_validate_json(payload)
    assert restored.trajectories[1].token_ids == tokenized.trajectories[1].token_ids
    assert math.isnan(restored.trajectories[0].logprobs[0])
    multi = group.tokenize(tokenizer=tokenizer, multi_history=True)
    assert isinstance(multi.trajectories[0], art.TokenizedMultiHistoryTrajectory)
    assert len(multi.trajectories[0].histories) == 1


def test_legacy_history_tokenizes_choices_as_art_does(tokenizer: Any) -> None:
    """A Choice with the engine's ids is EXACT | SAMPLED; one without ids (a server that returns none) is SAMPLED
    text rendered here (not EXACT); a plain assistant message is prompt."""
    p = prompt(tokenizer, HI)
    exact = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "yes"},
            "prompt_token_ids": p,
            "token_ids": [50, 51, tokenizer.eos_token_id],
        }
    )
    history = LegacyHistory(messages_and_choices=[*HI, exact])
    tokenized = history.tokenize(model="policy", tokenizer=tokenizer)
    assert isinstance(tokenized, art.TokenizedHistory) and tokenized.model == "policy"
    assert tokenized.flags == [EXACT] * len(p) + [EXACT | SAMPLED] * 3

    rendered = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "yes"}}
    )
    flags = (
        LegacyHistory(messages_and_choices=[*HI, rendered])
        .tokenize(model="policy", tokenizer=tokenizer)
        .flags
    )
    assert SAMPLED in flags and not any(f & EXACT for f in flags)

    plain = LegacyHistory(messages_and_choices=[*HI, {"role": "assistant", "content": "yes"}])
    assert not any(plain.tokenize(model="policy", tokenizer=tokenizer).flags)

    # ART's Trajectory holds LegacyHistory objects in additional_histories: each is one more history
    trajectory = art.Trajectory(
        messages_and_choices=[*HI, exact],
        additional_histories=[LegacyHistory(messages_and_choices=[*HI, rendered])],
    )
    assert len(trajectory.tokenize(tokenizer=tokenizer, multi_history=True).histories) == 2


def test_a_prompt_that_retokenizes_the_sampled_text_splits_unless_reconciled(tokenizer: Any) -> None:
    """The model sampled "hello" one character at a time; the next request's prompt, rendered from the text,
    tokenizes it canonically. Token for token the prompt does not extend the sampled tokens: two histories, unless
    `reconcile_text_equivalent_tokenizations`, which keeps the sampled tokens and continues after them."""
    eos = tokenizer.eos_token_id
    first_prompt = prompt(tokenizer, HI)
    sampled = byte_by_byte(tokenizer, "hello") + [eos]
    second_messages = [*HI, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    second_prompt = prompt(tokenizer, second_messages)
    assert second_prompt[: len(first_prompt) + len(sampled)] != first_prompt + sampled
    answer = tokenizer.encode("ok", add_special_tokens=False) + [eos]
    trajectory = art.Trajectory(llm_calls=[call(first_prompt, sampled), call(second_prompt, answer, -0.25)])

    split = trajectory.tokenize(tokenizer=tokenizer, multi_history=True)
    assert [h.token_ids for h in split.histories] == [first_prompt + sampled, second_prompt + answer]
    with pytest.raises(ValueError, match="multi_history=True"):
        trajectory.tokenize(tokenizer=tokenizer)

    merged = trajectory.tokenize(tokenizer=tokenizer, reconcile_text_equivalent_tokenizations=True)
    assert isinstance(merged, art.TokenizedTrajectory)
    canonical = tokenizer.encode("hello", add_special_tokens=False) + [eos]
    rest = second_prompt[len(first_prompt) + len(canonical) :]
    assert merged.token_ids == first_prompt + sampled + rest + answer
    assert merged.flags == [EXACT] * len(first_prompt) + [EXACT | SAMPLED] * len(sampled) + [EXACT] * len(
        rest
    ) + [EXACT | SAMPLED] * len(answer)
    assert merged.logprobs[-len(answer) :] == [-0.25] * len(answer)
    assert tokenizer.decode(merged.token_ids) == tokenizer.decode(second_prompt + answer)

    # a prompt that changes the text itself is never reconciled
    edited = prompt(
        tokenizer, [*HI, {"role": "assistant", "content": "help"}, {"role": "user", "content": "more"}]
    )
    other = art.Trajectory(llm_calls=[call(first_prompt, sampled), call(edited, answer)])
    assert (
        len(
            other.tokenize(
                tokenizer=tokenizer, multi_history=True, reconcile_text_equivalent_tokenizations=True
            ).histories
        )
        == 2
    )


def test_a_choices_reasoning_content_is_part_of_what_it_sampled(tokenizer: Any) -> None:
    """A Choice whose message carries vLLM's `reasoning_content` (ART's field) and no token ids: its rendered,
    sampled tokens include the thinking, under the chat template the port names (`chat_template=`)."""
    reasoning = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        }
    )
    history = LegacyHistory(messages_and_choices=[*HI, reasoning])
    tokenized = history.tokenize(model="policy", tokenizer=tokenizer, chat_template=QWEN3_CHAT_TEMPLATE)
    sampled = [t for t, f in zip(tokenized.token_ids, tokenized.flags, strict=True) if f & SAMPLED]
    assert "<think>\ntwo and two\n</think>" in tokenizer.decode(sampled) and "4" in tokenizer.decode(sampled)
    plain = history.tokenize(model="policy", tokenizer=tokenizer)  # the tokenizer's own template: no thinking
    assert "two and two" not in tokenizer.decode(plain.token_ids)
