"""Trajectory -> training sequences: trained ids are exactly the sampled ids, everything else is context."""

from __future__ import annotations

import json
import math

import pytest
from openai.types.chat.chat_completion import Choice

from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import (
    TokenizationError,
    chat_template_ids,
    sft_samples,
    tokenize_trajectory,
)
from art_adapters.trajectories import History, LLMCall, Trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path())


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def tool_call_message(city: str, call_id: str) -> dict:
    arguments = json.dumps({"city": city})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def tool_call_text(city: str) -> str:
    return (
        '<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps({"city": city})
        + "}\n</tool_call><|im_end|>"
    )


def make_call(tokenizer, messages, tools, completion_ids, logprob=-0.5, temperature=1.0) -> LLMCall:
    return LLMCall(
        request={"messages": messages, "tools": tools, "temperature": temperature},
        prompt_token_ids=chat_template_ids(tokenizer, messages, tools),
        completion_token_ids=completion_ids,
        logprobs=[logprob] * len(completion_ids),
        logprobs_mode="processed_logprobs",
    )


def agent_trajectory(tokenizer, cities=("Paris", "Tokyo", "Rome")) -> tuple[Trajectory, list[list[int]]]:
    """A multi-turn tool agent as the recording client captures it: one call per turn, engine-sampled ids."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in " + ", ".join(cities) + "?"},
    ]
    calls, sampled = [], []
    for i, city in enumerate(cities):
        ids = encode(tokenizer, tool_call_text(city))
        calls.append(make_call(tokenizer, list(messages), TOOLS, ids, logprob=-0.1 * (i + 1)))
        sampled.append(ids)
        messages += [
            tool_call_message(city, f"c{i}"),
            {"role": "tool", "tool_call_id": f"c{i}", "content": "21 C"},
        ]
    final = encode(tokenizer, "It is 21 degrees and sunny everywhere.<|im_end|>")
    calls.append(make_call(tokenizer, list(messages), TOOLS, final))
    sampled.append(final)
    return Trajectory(llm_calls=calls, tools=TOOLS, reward=1.0), sampled


def trained_ids(sequences) -> list[int]:
    return [t for s in sequences for t, m in zip(s.input_ids, s.trained_mask, strict=True) if m]


def test_multi_turn_tool_agent_trains_exactly_the_sampled_ids(tokenizer):
    trajectory, sampled = agent_trajectory(tokenizer)
    out = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096)
    assert len(out.sequences) == 1  # every turn's prompt extends the previous turn token for token
    seq = out.sequences[0]
    assert trained_ids(out.sequences) == [t for ids in sampled for t in ids]
    assert seq.input_ids == trajectory.llm_calls[-1].prompt_token_ids + sampled[-1]
    # Trained logprobs are the engine's, context logprobs are NaN; tool results are context.
    lps = [lp for lp, m in zip(seq.sampled_logprobs, seq.trained_mask, strict=True) if m]
    assert lps == [lp for call in trajectory.llm_calls for lp in call.logprobs]
    assert all(math.isnan(lp) for lp, m in zip(seq.sampled_logprobs, seq.trained_mask, strict=True) if not m)
    tool_result = encode(tokenizer, "<tool_response>\n21 C\n</tool_response>")
    start = next(
        i for i in range(len(seq.input_ids)) if seq.input_ids[i : i + len(tool_result)] == tool_result
    )
    assert not any(seq.trained_mask[start : start + len(tool_result)])


def test_divergent_sub_agent_call_starts_a_second_sequence(tokenizer):
    trajectory, sampled = agent_trajectory(tokenizer, cities=("Paris", "Rome"))
    summary_messages = [{"role": "user", "content": "Summarise: sunny."}]
    summary_ids = encode(tokenizer, "Sunny.<|im_end|>")
    sub = make_call(tokenizer, summary_messages, None, summary_ids, logprob=-2.0)
    trajectory.llm_calls.insert(1, sub)  # interleaved between the main agent's turns
    out = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096)
    assert len(out.sequences) == 2
    main, summary = out.sequences
    assert trained_ids([main]) == [t for ids in sampled for t in ids]
    assert trained_ids([summary]) == summary_ids
    assert summary.input_ids == sub.prompt_token_ids + summary_ids


def test_additional_histories_and_retokenization_drift(tokenizer):
    trajectory, sampled = agent_trajectory(tokenizer, cities=("Paris", "Rome"))
    # The engine sampled "Paris" byte by byte: the template re-renders it differently, so the next prompt
    # no longer extends the sequence and starts a new one; both keep exactly their sampled ids.
    first = trajectory.llm_calls[0]
    text = tool_call_text("Paris")
    head, tail = text.split("Paris")
    odd = encode(tokenizer, head) + [encode(tokenizer, ch)[0] for ch in "Paris"] + encode(tokenizer, tail)
    assert odd != first.completion_token_ids
    first.completion_token_ids = odd
    first.logprobs = [-0.3] * len(odd)
    history = History(
        llm_calls=[make_call(tokenizer, [{"role": "user", "content": "hi"}], None, [5, 6, 763])]
    )
    trajectory.additional_histories.append(history)
    out = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096)
    assert len(out.sequences) == 3
    expected = odd + [t for ids in sampled[1:] for t in ids] + [5, 6, 763]
    assert trained_ids(out.sequences) == expected


def test_hand_built_choices_train_the_same_way(tokenizer):
    trajectory, sampled = agent_trajectory(tokenizer)
    captured = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096).sequences
    # The same rollout as ART users write it: messages and Choices carrying token ids (no captured calls).
    items: list = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris, Tokyo, Rome?"},
    ]
    for i, city in enumerate(("Paris", "Tokyo", "Rome")):
        message = tool_call_message(city, f"c{i}")
        logprobs = {
            "content": [{"token": "x", "logprob": -0.1 * (i + 1), "top_logprobs": []}] * len(sampled[i])
        }
        choice = {"index": 0, "finish_reason": "tool_calls", "message": message, "logprobs": logprobs}
        items.append(Choice.model_validate({**choice, "token_ids": sampled[i]}))
        items.append({"role": "tool", "tool_call_id": f"c{i}", "content": "21 C"})
    final = {"role": "assistant", "content": "It is 21 degrees and sunny everywhere."}
    last = {"index": 0, "finish_reason": "stop", "message": final, "token_ids": sampled[3]}
    items.append(
        Choice.model_validate({**last, "prompt_token_ids": trajectory.llm_calls[3].prompt_token_ids})
    )
    hand = Trajectory(messages_and_choices=items, tools=TOOLS, reward=1.0)
    out = tokenize_trajectory(Trajectory.from_json(hand.to_json()), tokenizer, max_seq_len=4096)
    assert [s.input_ids for s in out.sequences] == [s.input_ids for s in captured]
    assert [s.trained_mask for s in out.sequences] == [s.trained_mask for s in captured]
    lps = [
        lp
        for lp, m in zip(out.sequences[0].sampled_logprobs, out.sequences[0].trained_mask, strict=True)
        if m
    ]
    assert lps[: len(sampled[0])] == pytest.approx([-0.1] * len(sampled[0]))
    assert all(math.isnan(lp) for lp in lps[-len(sampled[3]) :])  # that Choice carried no logprobs


def test_finished_trajectory_counts_each_sampled_call_once(tokenizer):
    """`finish()` mirrors the calls as Choices and sub-agent histories; each sample is still trained once."""
    trajectory, sampled = agent_trajectory(tokenizer, cities=("Paris", "Rome"))
    summary_ids = encode(tokenizer, "Sunny.<|im_end|>")
    sub = make_call(tokenizer, [{"role": "user", "content": "Summarise: sunny."}], None, summary_ids)
    trajectory.llm_calls.insert(1, sub)
    for call in trajectory.llm_calls:
        call.response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]}
    before = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096).sequences
    trajectory.finish()
    after = tokenize_trajectory(Trajectory.from_json(trajectory.to_json()), tokenizer, max_seq_len=4096)
    assert sorted(trained_ids(after.sequences)) == sorted([t for ids in sampled for t in ids] + summary_ids)
    assert [s.input_ids for s in after.sequences] == [s.input_ids for s in before]


def test_a_trajectory_longer_than_max_seq_len_is_skipped_whole_never_truncated(tokenizer):
    trajectory, sampled = agent_trajectory(tokenizer)
    full = tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096).sequences[0]
    exact = tokenize_trajectory(trajectory, tokenizer, max_seq_len=len(full))
    assert not exact.skipped and exact.too_long == 0 and exact.sequences[0].input_ids == full.input_ids
    over = tokenize_trajectory(
        trajectory, tokenizer, max_seq_len=len(full) - 1, group_index=2, trajectory_index=5
    )
    assert over.skipped and not over.sequences and over.too_long == len(full)
    assert (
        over.reason
        == f"trajectory 5 of group 2 is {len(full)} tokens long (max_seq_len={len(full) - 1}); skipped"
    )
    assert over.excluded_tokens == over.missing_tokens == over.left_out_tokens == 0  # nothing of it counted


def test_a_history_split_into_sequences_is_judged_by_its_longest(tokenizer):
    """Two sequences (the second call's prompt does not extend the first): each is its own row, so the limit is
    the longest one's length, not their sum; one over it skips the whole trajectory."""
    trajectory, _ = agent_trajectory(tokenizer, cities=("Paris",))
    other, _ = agent_trajectory(tokenizer, cities=("Oslo", "Lima"))
    split = Trajectory(llm_calls=[*trajectory.llm_calls, *other.llm_calls], tools=TOOLS)
    rows = tokenize_trajectory(split, tokenizer, max_seq_len=4096).sequences
    assert len(rows) == 2
    longest, total = max(len(r) for r in rows), sum(len(r) for r in rows)
    fits = tokenize_trajectory(split, tokenizer, max_seq_len=longest)
    assert (
        total > longest
        and not fits.skipped
        and [s.input_ids for s in fits.sequences] == [r.input_ids for r in rows]
    )
    over = tokenize_trajectory(split, tokenizer, max_seq_len=longest - 1)
    assert over.skipped and over.sequences == [] and over.too_long == longest


def test_trajectory_without_sampled_ids_is_skipped_with_its_reason(tokenizer, caplog):
    """The reason is on the result, not a warning per trajectory: the step warns once with the counts
    (tests/test_skipped_steps.py)."""
    text_only = Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        reward=1.0,
    )
    no_ids = LLMCall(request={"messages": [{"role": "user", "content": "hi"}]}, response={"choices": []})
    with caplog.at_level("WARNING"):
        out = tokenize_trajectory(text_only, tokenizer, max_seq_len=64, trajectory_index=3, group_index=1)
        out2 = tokenize_trajectory(Trajectory(llm_calls=[no_ids]), tokenizer, max_seq_len=64)
    assert out.skipped and out2.skipped and not out.sequences
    assert "trajectory 3 of group 1" in out.reason and "no sampled token ids" in out.reason
    assert out.skip_kind == out2.skip_kind == "no_sampled_ids" and not caplog.records


def test_foreign_token_ids_raise_a_clear_error(tokenizer):
    trajectory, _ = agent_trajectory(tokenizer, cities=("Paris",))
    trajectory.llm_calls[0].completion_token_ids = [5, 151643]
    trajectory.llm_calls[0].logprobs = [-1.0, -1.0]
    with pytest.raises(TokenizationError, match=r"trajectory 2 of group 7.*different tokenizer"):
        tokenize_trajectory(trajectory, tokenizer, max_seq_len=4096, group_index=7, trajectory_index=2)


def test_missing_raw_or_greedy_logprobs_become_nan_and_temperatures_split(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    raw = make_call(tokenizer, messages, None, [5, 6, 763], temperature=0.7)
    raw.logprobs_mode = "raw_logprobs"  # logprobs of the raw logits, not of the T=0.7 sampling distribution
    out = tokenize_trajectory(Trajectory(llm_calls=[raw]), tokenizer, max_seq_len=64)
    seq = out.sequences[0]
    assert seq.temperature == 0.7 and all(math.isnan(x) for x in seq.sampled_logprobs)
    greedy = make_call(tokenizer, messages, None, [5, 763], temperature=0.0)
    assert (
        tokenize_trajectory(Trajectory(llm_calls=[greedy]), tokenizer, max_seq_len=64)
        .sequences[0]
        .temperature
        == 1.0
    )
    # A continuation sampled at another temperature becomes its own sequence (one temperature per row).
    first = make_call(tokenizer, messages, None, encode(tokenizer, "hello<|im_end|>"), temperature=1.0)
    follow = messages + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    second = make_call(tokenizer, follow, None, [7, 763], temperature=0.5)
    out = tokenize_trajectory(Trajectory(llm_calls=[first, second]), tokenizer, max_seq_len=256)
    assert [s.temperature for s in out.sequences] == [1.0, 0.5]


def test_sft_samples_cover_the_assistant_turns(tokenizer):
    answer = {"role": "assistant", "content": "It is 21 degrees and sunny everywhere."}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        tool_call_message("Paris", "c0"),
        {"role": "tool", "tool_call_id": "c0", "content": "21 C"},
        answer,
    ]
    samples = sft_samples(Trajectory(messages_and_choices=messages, tools=TOOLS), tokenizer)
    assert len(samples) == 2
    # The re-rendered assistant turns (the tool call, the answer), each ending in <|im_end|>: the template's "\n"
    # after it is the next prompt's, never something a model samples.
    assert samples[0].completion_ids == encode(tokenizer, tool_call_text("Paris"))
    assert samples[1].completion_ids == encode(tokenizer, answer["content"] + "<|im_end|>")
    assert samples[1].prompt_ids == chat_template_ids(tokenizer, messages[:3], TOOLS)


@pytest.mark.parametrize(
    ("settings", "mode", "reason"),
    [
        ({"top_p": 0.9}, "processed_logprobs", "top_p"),
        ({"tool_choice": "required"}, "processed_logprobs", "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "processed_logprobs",
            "response_format",
        ),
        (
            {"logit_bias": {"5": 3}, "presence_penalty": 0.5},
            "processed_logprobs",
            "presence_penalty, logit_bias",
        ),
        ({"temperature": 0.7}, None, "unknown-kind logprobs at temperature 0.7"),
        # grammars vLLM enforces: strict tools (chat and Responses forms), Responses text.format, structural tags
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}]},
            "processed_logprobs",
            "strict tools",
        ),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True}]},
            "processed_logprobs",
            "strict tools",
        ),
        ({"text": {"format": {"type": "json_object"}}}, "processed_logprobs", "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}},
            "processed_logprobs",
            "text.format",
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
            "processed_logprobs",
            "response_format",
        ),
    ],
)
def test_tokens_sampled_under_settings_the_trainer_cannot_reproduce_lose_their_ratio(
    tokenizer, settings, mode, reason
):
    call = make_call(tokenizer, [{"role": "user", "content": "hi"}], None, [5, 6, 763])
    call.request.update(settings)
    call.logprobs_mode = mode
    out = tokenize_trajectory(Trajectory(llm_calls=[call]), tokenizer, max_seq_len=64)
    assert out.excluded_tokens == 3 and out.excluded_reasons == {reason}
    assert all(
        math.isnan(x)
        for x, m in zip(out.sequences[0].sampled_logprobs, out.sequences[0].trained_mask, strict=True)
        if m
    )
    neutral = make_call(tokenizer, [{"role": "user", "content": "hi"}], None, [5, 6, 763], temperature=0.7)
    neutral.request.update({"top_p": 1.0, "top_k": -1, "tool_choice": "auto"})
    kept = tokenize_trajectory(Trajectory(llm_calls=[neutral]), tokenizer, max_seq_len=64)
    assert kept.excluded_tokens == 0 and kept.sequences[0].temperature == 0.7
    assert kept.sequences[0].sampled_logprobs[-1] == -0.5


def test_a_hand_built_choice_trains_at_the_temperature_it_was_sampled_at(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    ids = encode(tokenizer, "hello<|im_end|>")
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "hello"},
            "token_ids": ids,
            "prompt_token_ids": chat_template_ids(tokenizer, messages, None),
            "sampling": {"temperature": 0.7, "unreproducible": []},
            "logprobs": {
                "content": [{"token": "x", "logprob": -0.25, "bytes": None, "top_logprobs": []}] * len(ids)
            },
        }
    )
    out = tokenize_trajectory(Trajectory(messages_and_choices=[*messages, choice]), tokenizer, max_seq_len=64)
    assert out.sequences[0].temperature == 0.7 and out.excluded_tokens == 0
    choice.model_extra["sampling"] = {"temperature": 0.7, "unreproducible": ["top_p"]}
    out = tokenize_trajectory(Trajectory(messages_and_choices=[*messages, choice]), tokenizer, max_seq_len=64)
    assert out.excluded_tokens == len(ids) and out.excluded_reasons == {"top_p"}


def test_n_choices_train_only_the_one_the_agent_kept(tokenizer):
    from art_adapters.trajectories import SampledChoice

    messages = [{"role": "user", "content": "hi"}]
    first = make_call(tokenizer, messages, None, encode(tokenizer, "one<|im_end|>"))
    first.other_choices = [
        SampledChoice(index=1, token_ids=encode(tokenizer, "two<|im_end|>"), logprobs=[-1.0] * 5)
    ]
    first.response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "one"}}]}
    follow = messages + [{"role": "assistant", "content": "two"}, {"role": "user", "content": "and?"}]
    second = make_call(tokenizer, follow, None, [7, 763])
    alone = tokenize_trajectory(Trajectory(llm_calls=[first]), tokenizer, max_seq_len=256)
    assert trained_ids(alone.sequences) == encode(
        tokenizer, "one<|im_end|>"
    )  # nothing kept: the first choice
    both = tokenize_trajectory(Trajectory(llm_calls=[first, second]), tokenizer, max_seq_len=256)
    assert trained_ids(both.sequences) == encode(tokenizer, "two<|im_end|>") + [7, 763]  # the continued one
    everything = tokenize_trajectory(
        Trajectory(llm_calls=[first, second]), tokenizer, max_seq_len=256, train_unkept_choices=True
    )
    assert sorted(trained_ids(everything.sequences)) == sorted(
        encode(tokenizer, "one<|im_end|>") + encode(tokenizer, "two<|im_end|>") + [7, 763]
    )


def test_retokenized_text_trains_neither_a_captured_turn_twice_nor_the_templates_newline(tokenizer):
    """`train_retokenized_text=True` trains plain assistant turns as the template renders them, up to and including
    their end-of-turn token (the newline after it is the next prompt's), and leaves out a turn a captured call
    already answered with sampled ids (that call's ids train it, exactly)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    question = [{"role": "user", "content": "hi"}]
    call = make_call(tokenizer, question, None, [*encode(tokenizer, "hello there"), end])
    call.response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"}}]}
    follow_up = [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "bye now"}]
    items = [*question, {"role": "assistant", "content": "hello there"}, *follow_up]  # plain dicts only
    trajectory = Trajectory(messages_and_choices=items, llm_calls=[call])
    out = tokenize_trajectory(trajectory, tokenizer, max_seq_len=512, train_retokenized_text=True)
    trained = [t for s in out.sequences for t, m in zip(s.input_ids, s.trained_mask, strict=True) if m]
    sampled = call.completion_token_ids or []
    rendered = [*encode(tokenizer, "bye now"), end]  # the template's "\n" after <|im_end|> is not trained
    assert trained == sampled + rendered
    assert out.sampled_token_fraction == pytest.approx(len(sampled) / (len(sampled) + len(rendered)))
