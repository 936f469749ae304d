"""drop_secrets and token ids: ids decode back to the text they encode, so a call (or Choice) whose text a
redaction changed keeps no ids or logprobs that could spell the secret, and never trains as sampled."""

from __future__ import annotations

from typing import Any

import pytest

from art_adapters.redaction import REDACTED, drop_secrets
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import chat_template_ids, samples_of, tokenize_trajectory
from art_adapters.trajectories import LLMCall, Trajectory

SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUv123456"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path())


def call_of(tokenizer: Any, messages: list[dict[str, Any]], answer: str) -> LLMCall:
    """A call as the recording client captures it from vLLM: ids in the call and copies in the body."""
    prompt = chat_template_ids(tokenizer, messages, None)
    completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in completion]
    return LLMCall(
        request={"model": "m", "messages": messages},
        url="/v1/chat/completions",
        status_code=200,
        response={
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer},
                    "finish_reason": "stop",
                    "token_ids": completion,
                    "logprobs": {
                        "content": [{"token": p, "logprob": -0.5, "top_logprobs": []} for p in pieces]
                    },
                }
            ],
        },
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
        logprobs_mode="processed_logprobs",
    )


def id_lists(value: Any) -> list[list[int]]:
    """Every list of ints anywhere in a dump (where token ids hide)."""
    if isinstance(value, dict):
        return [ids for v in value.values() for ids in id_lists(v)]
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        return [ids for v in value for ids in id_lists(v)]
    return []


def assert_no_secret(tokenizer: Any, trajectory: Trajectory) -> None:
    dump = trajectory.model_dump(mode="json")
    assert SECRET not in trajectory.model_dump_json()
    for ids in id_lists(dump):
        assert SECRET not in tokenizer.decode(ids).replace(" ", "")
    pieces = [e["token"] for c in _choices(dump) for e in ((c.get("logprobs") or {}).get("content") or [])]
    assert SECRET not in "".join(pieces)


def _choices(dump: dict[str, Any]) -> list[dict[str, Any]]:
    out = [c for call in dump["llm_calls"] for c in (call["response"] or {}).get("choices") or []]
    return out + [i for i in dump["messages_and_choices"] if isinstance(i, dict) and "message" in i]


def test_a_secret_in_prompt_and_answer_leaves_no_ids_that_spell_it(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": f"deploy with key {SECRET} please"}]
    trajectory = Trajectory(llm_calls=[call_of(tokenizer, messages, f"Done, I used {SECRET}.")]).finish()
    before = trajectory.model_dump(mode="json")
    assert any(SECRET in tokenizer.decode(ids) for ids in id_lists(before))  # the ids did spell it

    redacted = drop_secrets(trajectory)
    (call,) = redacted.llm_calls
    assert call.request["messages"][0]["content"] == f"deploy with key {REDACTED} please"
    assert call.prompt_token_ids is None and call.completion_token_ids is None and call.logprobs is None
    assert_no_secret(tokenizer, redacted)
    assert redacted.metadata["redacted_token_ids"] == 2  # the call and its Choice in the conversation
    assert samples_of(redacted, tokenizer) == []
    assert tokenize_trajectory(redacted, tokenizer, max_seq_len=4096).skipped  # never trained as sampled
    assert trajectory.llm_calls[0].prompt_token_ids is not None  # the input is untouched


def test_a_secret_in_the_answer_only_keeps_the_prompt_ids(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "which key did you use?"}]
    call = call_of(tokenizer, messages, f"This one: {SECRET}")
    redacted = drop_secrets(Trajectory(llm_calls=[call]).finish())
    (out,) = redacted.llm_calls
    assert out.prompt_token_ids == call.prompt_token_ids
    assert out.completion_token_ids is None and out.logprobs is None
    assert "token_ids" not in out.response["choices"][0] and "logprobs" not in out.response["choices"][0]
    assert_no_secret(tokenizer, redacted)
    assert tokenize_trajectory(redacted, tokenizer, max_seq_len=4096).skipped


def test_a_secret_in_the_prompt_only_drops_the_prompt_ids(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": f"my key is {SECRET}, keep it"}]
    call = call_of(tokenizer, messages, "Noted.")
    redacted = drop_secrets(Trajectory(llm_calls=[call]).finish())
    (out,) = redacted.llm_calls
    assert out.prompt_token_ids is None and "prompt_token_ids" not in out.response
    assert_no_secret(tokenizer, redacted)
    assert tokenize_trajectory(redacted, tokenizer, max_seq_len=4096).skipped


def test_only_the_turns_after_a_secret_lose_their_ids(tokenizer: Any) -> None:
    """A clean first turn still trains as sampled; the turn whose prompt holds the secret does not."""
    first = [{"role": "user", "content": "hello"}]
    call1 = call_of(tokenizer, first, "Hi! What can I do?")
    second = first + [
        {"role": "assistant", "content": "Hi! What can I do?"},
        {"role": "user", "content": f"use {SECRET}"},
    ]
    call2 = call_of(tokenizer, second, "Done.")
    trajectory = Trajectory(llm_calls=[call1, call2]).finish()
    redacted = drop_secrets(trajectory)
    out1, out2 = redacted.llm_calls
    assert out1.prompt_token_ids == call1.prompt_token_ids
    assert out1.completion_token_ids == call1.completion_token_ids and out1.logprobs == call1.logprobs
    assert out2.prompt_token_ids is None
    assert_no_secret(tokenizer, redacted)
    trained = samples_of(redacted, tokenizer)
    assert [s.completion_ids for s in trained] == [call1.completion_token_ids]


def test_a_trajectory_without_secrets_keeps_every_id(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hello"}]
    trajectory = Trajectory(llm_calls=[call_of(tokenizer, messages, "Hi.")]).finish()
    redacted = drop_secrets(trajectory)
    assert redacted.llm_calls[0] == trajectory.llm_calls[0]
    assert "redacted_token_ids" not in redacted.metadata
    assert len(samples_of(redacted, tokenizer)) == 1
