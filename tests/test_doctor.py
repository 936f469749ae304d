"""The drift doctor on trajectories of both Qwen families where each cause of a broken chain is made on purpose.

Each call is built as the engine would have seen it: prompt ids from the family's chat template, completion ids the
"model sampled" (canonical ids of a text, or deliberately other ones), the response vLLM would send back. The CLI
runs on a written JSONL file, as a user would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from art_adapters.cli import main
from art_adapters.doctor import CAUSES, diagnose
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.trajectories import LLMCall, Trajectory, write_jsonl

TOOLS = [{"type": "function", "function": {"name": "roll", "description": "Roll.", "parameters": {}}}]
START = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Roll a die."}]
CANONICAL_CALL = '<tool_call>\n{"name": "roll", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def tok(request: pytest.FixtureRequest) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(request.param))
    tokenizer.family = request.param
    return tokenizer


def sampled(
    tok: Any,
    messages: list[dict[str, Any]],
    text: str,
    *,
    ids: list[int] | None = None,
    finish: str = "stop",
    message: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] = TOOLS,
    **template_kwargs: Any,
) -> LLMCall:
    """A call whose engine saw `messages` and sampled `text` (or `ids`), ending at <|im_end|> unless cut off."""
    prompt = chat_template_ids(tok, messages, tools or None, **template_kwargs)
    completion = list(ids if ids is not None else tok.encode(text, add_special_tokens=False))
    if finish == "stop":
        completion.append(tok.convert_tokens_to_ids("<|im_end|>"))
    reply = message or {"role": "assistant", "content": text}
    request: dict[str, Any] = {"model": "m", "messages": messages, "tools": tools}
    if template_kwargs:
        request["chat_template_kwargs"] = template_kwargs
    return LLMCall(
        request=request,
        response={"choices": [{"index": 0, "message": reply, "finish_reason": finish}]},
        prompt_token_ids=list(prompt),
        completion_token_ids=completion,
        logprobs=[-1.0] * len(completion),
    )


def tool_reply(arguments: str, content: str | None = None) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "roll", "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def two_turns(tok: Any, text: str, reply: dict[str, Any], **kwargs: Any) -> Trajectory:
    first = sampled(tok, START, text, message=reply, **kwargs)
    history = [*START, reply, {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    second = sampled(tok, history, "You rolled 4.", **kwargs)
    return Trajectory(llm_calls=[first, second], reward=1.0)


def only_cause(tok: Any, trajectory: Trajectory) -> tuple[Any, list[str]]:
    report = diagnose([trajectory], tok)
    first, second = report.calls
    assert first.chained is None and first.template_matches  # a first turn
    assert second.template_matches, "the synthetic prompt is the template's own rendering"
    return second, second.causes


def test_a_canonical_tool_call_chains(tok: Any) -> None:
    second, causes = only_cause(tok, two_turns(tok, CANONICAL_CALL, tool_reply("{}")))
    assert second.chained and causes == [] and second.extra_context_tokens == 0
    assert diagnose([two_turns(tok, CANONICAL_CALL, tool_reply("{}"))], tok).chaining_rate == 1.0


def test_reserialized_arguments(tok: Any) -> None:
    text = '<tool_call>\n{"name": "roll", "arguments": {"n":1}}\n</tool_call>'  # no space after the colon
    second, causes = only_cause(tok, two_turns(tok, text, tool_reply('{"n":1}')))
    assert second.chained is False and causes == ["arguments"]
    assert '"n":1' in second.sequence_window.replace("⟦", "").replace("⟧", "")
    assert second.extra_context_tokens > 100 and second.diverge_at is not None


def test_whitespace_at_the_boundary(tok: Any) -> None:
    # vLLM hands back the text before the call as content; the template adds its own "\n" before <tool_call>.
    text = "Rolling.\n" + CANONICAL_CALL
    second, causes = only_cause(tok, two_turns(tok, text, tool_reply("{}", content="Rolling.\n")))
    assert second.chained is False and causes == ["boundary"]


def test_non_canonical_tokens_of_the_same_text(tok: Any) -> None:
    pieces = [tok.convert_tokens_to_ids(t) for t in ("Y", "ou")]  # "You" is one token in Qwen's vocabulary
    ids = pieces + tok.encode(" rolled 4.", add_special_tokens=False)
    assert tok.decode(ids) == "You rolled 4." and tok.encode("You rolled 4.", add_special_tokens=False) != ids
    first = sampled(tok, START, "You rolled 4.", ids=ids)
    history = [
        *START,
        {"role": "assistant", "content": "You rolled 4."},
        {"role": "user", "content": "Again"},
    ]
    second = sampled(tok, history, "OK.")
    call, causes = only_cause(tok, Trajectory(llm_calls=[first, second]))
    assert call.chained is False and causes == ["retokenized"]


def test_truncated_completion(tok: Any) -> None:
    # Cut off at max_tokens inside a character: the client gets "\ufffd" back and sends that as history.
    die = tok.encode("𓂀", add_special_tokens=False)  # a rare character: several byte-level tokens
    assert len(die) > 1
    ids = tok.encode("You rolled ", add_special_tokens=False) + die[:1]
    text = tok.decode(ids)
    assert text.endswith("\ufffd")
    first = sampled(tok, START, text, ids=ids, finish="length")
    history = [*START, {"role": "assistant", "content": text}, {"role": "user", "content": "Go on"}]
    call, causes = only_cause(tok, Trajectory(llm_calls=[first, sampled(tok, history, "4.")]))
    assert call.chained is False and causes == ["truncated"]


def test_edited_history(tok: Any) -> None:
    first = sampled(tok, START, "Four.")
    history = [START[1], {"role": "assistant", "content": "Four."}, {"role": "user", "content": "Again"}]
    call, causes = only_cause(tok, Trajectory(llm_calls=[first, sampled(tok, history, "Five.")]))
    assert call.chained is False and causes == ["system"]  # the agent dropped the system message


def test_the_way_a_framework_reshaped_history_is_named(tok: Any) -> None:
    """What agent frameworks do between calls (seen in the framework matrix), each named in words."""
    first = sampled(tok, START, "Four.")
    again = {"role": "user", "content": "Again"}
    answered = [*START, {"role": "assistant", "content": "Four."}, again]
    reshaped = {
        "tools": sampled(
            tok, answered, "Five.", tools=[]
        ),  # AutoGen's reflection call goes without its tools
        # a window kept the last answer only: the first question is gone
        "trimmed": sampled(tok, [START[0], {"role": "assistant", "content": "Four."}, again], "Five."),
        "edited": sampled(tok, [*START, {"role": "assistant", "content": "It was four."}, again], "Five."),
    }
    for cause, second in reshaped.items():
        call, causes = only_cause(tok, Trajectory(llm_calls=[first, second]))
        assert call.chained is False and causes == [cause]
        assert CAUSES[cause]  # and the report explains it in words
    assert only_cause(tok, Trajectory(llm_calls=[first, sampled(tok, answered, "Five.")]))[0].chained


def test_reasoning_stripped_by_qwen3(tok: Any) -> None:
    if tok.family != "qwen3":
        pytest.skip("Qwen2.5 has no reasoning format")
    text = "<think>\nI should roll.\n</think>\n\n" + CANONICAL_CALL
    # The client sends the call back without its reasoning (the common case: reasoning_content is dropped).
    second, causes = only_cause(tok, two_turns(tok, text, tool_reply("{}")))
    assert second.chained is False and causes == ["reasoning"]
    assert "think" in second.sequence_window
    # Sent back as `reasoning` (vLLM's field), the exchange chains: Qwen3 keeps reasoning after the last query.
    kept = tool_reply("{}") | {"reasoning": "I should roll."}
    second, causes = only_cause(tok, two_turns(tok, text, kept))
    assert second.chained and causes == []
    # vLLM does not read `reasoning_content` from a request: sent under that name, the reasoning is stripped.
    kept = tool_reply("{}") | {"reasoning_content": "I should roll."}
    second, causes = only_cause(tok, two_turns(tok, text, kept))
    assert second.chained is False and causes == ["reasoning"]
    # Thinking off: the prompt pre-fills an empty block that history never renders back.
    second, causes = only_cause(tok, two_turns(tok, CANONICAL_CALL, tool_reply("{}"), enable_thinking=False))
    assert second.chained is False and causes == ["reasoning"]


def test_a_different_template_and_the_cli(
    tok: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trajectory = two_turns(
        tok, '<tool_call>\n{"name": "roll", "arguments": {"n":1}}\n</tool_call>', tool_reply("{}")
    )
    path = write_jsonl(tmp_path / "t.jsonl", [trajectory, two_turns(tok, CANONICAL_CALL, tool_reply("{}"))])
    other = "qwen3" if tok.family == "qwen2.5" else "qwen2.5"
    assert main(["doctor", str(path), "--model", str(tiny_model_path(other)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Same text, other ids: <tool_response> is one token in Qwen3 and plain text in Qwen2.5 (second turns only).
    assert out["summary"]["template_mismatches"] == 2
    assert [("template" in call["causes"]) for call in out["calls"]] == [False, True, False, True]
    cli = [str(Path(sys.executable).parent / "art-adapters"), "doctor", str(path)]
    done = subprocess.run([*cli, "--model", str(tiny_model_path(tok.family))], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert "4 calls, 2 continue a conversation, 1 chain (chaining rate 0.500)" in " ".join(
        done.stdout.split()
    )
    assert "re-serialized" in done.stdout and "template does not reproduce" in done.stdout
    assert set(CAUSES) == {
        "truncated",
        "reasoning",
        "arguments",
        "boundary",
        "retokenized",
        "edited",
        "tools",
        "system",
        "trimmed",
        "template",
        "temperature",
    }


def test_chaining_is_judged_as_the_trainer_merges(tok: Any) -> None:
    """A, then B continuing A, then C continuing A but not B (a retried turn): the trainer merges A+B into one
    sequence, which C does not extend, so C trains as a sequence of its own; the doctor says so (it used to call
    C chained because C extends A)."""
    from art_adapters.training.tokenize import tokenize_trajectory

    first = sampled(tok, START, "Four.")
    history = [*START, {"role": "assistant", "content": "Four."}]
    second = sampled(tok, [*history, {"role": "user", "content": "Again"}], "Five.")
    retry = sampled(tok, [*history, {"role": "user", "content": "Once more"}], "Six.")
    trajectory = Trajectory(llm_calls=[first, second, retry])
    trained = tokenize_trajectory(trajectory, tok, max_seq_len=4096)
    assert len(trained.sequences) == 2  # A+B, and C alone
    report = diagnose([trajectory], tok)
    assert [(c.continues, c.chained) for c in report.calls] == [(None, None), (0, True), (1, False)]
    assert report.calls[2].causes == ["edited"] and report.calls[2].extra_context_tokens > 0
    # C at another temperature than A+B: a training sequence has one temperature, so that too is a break
    hot = sampled(
        tok,
        [
            *history,
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "Five."},
            {"role": "user", "content": "Go"},
        ],
        "Seven.",
    )
    hot.request["temperature"] = 0.7
    report = diagnose([Trajectory(llm_calls=[first, second, hot])], tok)
    assert (report.calls[2].chained, report.calls[2].causes) == (False, ["temperature"])


def test_a_missing_trajectories_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such file or folder: .*nowhere.jsonl"):
        main(["doctor", str(tmp_path / "nowhere.jsonl"), "--model", str(tmp_path)])
