"""The drift doctor: for every captured call, does its prompt continue the tokens sampled before it, and if not, why.

`art-adapters doctor TRAJECTORIES.jsonl --model DIR` re-renders each request with the model's chat template and
compares it with the prompt ids the engine saw, then compares that prompt with the sequence (prompt + completion) of
the earlier call it continues. A call that continues it chains (one training sequence for the whole conversation);
one that does not is still trained exactly, on its own ids, and the doctor names the first diverging token and why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .trajectories import LLMCall, Trajectory, read_jsonl

WINDOW = 6  # tokens of text shown on each side of the first diverging token

CAUSES = {
    "truncated": "the previous completion was cut off (max_tokens or a broken stream), so the template closes "
    "the turn with tokens the model never sampled",
    "reasoning": "reasoning stripped by the template (the sampled <think> block is not rendered back into "
    "history)",
    "arguments": "tool-call arguments re-serialized: the template renders the parsed JSON, not the text the "
    "model sampled",
    "boundary": "whitespace/merge across a message boundary: where the sampled text meets the template's, the "
    "history renders other whitespace or merges into other tokens",
    "retokenized": "the model sampled a non-canonical tokenization of its text; re-encoding the same text gives "
    "other ids",
    "tools": "the tool list changed between the calls (an agent that drops its tools for a final or reflection "
    "call): the tools render at the top of the prompt, so nothing before them carries over",
    "system": "the system prompt changed between the calls (another agent's instructions, or a prompt that "
    "embeds a step counter, the date or the history)",
    "trimmed": "earlier messages were dropped or summarised: the history sent is shorter than the one sampled",
    "edited": "the history sent differs from what was sampled (the agent re-wrote or reordered messages, e.g. "
    "tool calls rendered back as text)",
    "template": "a different template or tokenizer: the model folder's chat template does not render this "
    "request to the ids the engine saw",
    "temperature": "sampled at another temperature than the sequence it extends (a training sequence has one "
    "temperature)",
}


class CallDiagnosis(BaseModel):
    """One call: whether it chains, whether the template reproduces its prompt, and the first divergence."""

    trajectory: int
    call: int
    continues: int | None = Field(None, description="index of the earlier call whose sequence it follows")
    chained: bool | None = Field(None, description="None: a first turn (no assistant message in its history)")
    template_matches: bool | None = None
    diverge_at: int | None = Field(
        None, description="prompt token index where it leaves the earlier sequence"
    )
    sequence_window: str = ""
    prompt_window: str = ""
    causes: list[str] = Field(default_factory=list)
    extra_context_tokens: int = Field(0, description="tokens re-fed because the call starts a new sequence")
    sampled_tokens: int = 0


class DriftReport(BaseModel):
    """Every call's diagnosis plus the totals a run is judged by."""

    calls: list[CallDiagnosis]

    @property
    def continuing(self) -> list[CallDiagnosis]:
        return [c for c in self.calls if c.chained is not None]

    @property
    def chaining_rate(self) -> float:
        continuing = self.continuing
        return sum(bool(c.chained) for c in continuing) / len(continuing) if continuing else 1.0

    @property
    def extra_context_tokens(self) -> int:
        return sum(c.extra_context_tokens for c in self.calls)

    def summary(self) -> dict[str, Any]:
        causes: dict[str, int] = {}
        for call in self.calls:
            for cause in call.causes:
                causes[cause] = causes.get(cause, 0) + 1
        return {
            "calls": len(self.calls),
            "continuing_calls": len(self.continuing),
            "chained": sum(bool(c.chained) for c in self.continuing),
            "chaining_rate": round(self.chaining_rate, 4),
            "extra_context_tokens": self.extra_context_tokens,
            "template_mismatches": sum(c.template_matches is False for c in self.calls),
            "causes": causes,
        }


def diagnose(trajectories: list[Trajectory], tokenizer: Any) -> DriftReport:
    """Diagnose every captured call of `trajectories` (those with engine token ids) against `tokenizer`.

    Chaining is judged as the trainer merges calls (`training/tokenize.py`): a call continues the newest training
    sequence its prompt extends token for token (at the same temperature), and a sequence ends with the last call
    merged into it, so a call that extends an older call but not the sequence that call grew into is a break."""
    out: list[CallDiagnosis] = []
    for t_index, trajectory in enumerate(trajectories):
        calls = [c for c in trajectory.llm_calls if c.prompt_token_ids and c.completion_token_ids is not None]
        ends: list[int] = []  # per training sequence, the index of the last call merged into it
        for c_index, call in enumerate(calls):
            result, continued = _diagnose_call(t_index, c_index, call, calls, ends, tokenizer)
            out.append(result)
            if continued is None:
                ends.append(c_index)
            else:
                ends[continued] = c_index
    return DriftReport(calls=out)


def _sequence(call: LLMCall) -> list[int]:
    """The ids of the training sequence that ends with `call` (a merged sequence always equals its last call's
    prompt + completion, since each call it takes extends it)."""
    return list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])


def _temperature(call: LLMCall) -> float:
    value = call.request.get("temperature")
    value = 1.0 if value is None else float(value)
    return 1.0 if value < 1e-5 else value  # greedy calls train at the trainer's own T=1, as samples.py does


def _diagnose_call(
    t_index: int, c_index: int, call: LLMCall, calls: list[LLMCall], ends: list[int], tokenizer: Any
) -> tuple[CallDiagnosis, int | None]:
    """The call's diagnosis and the training sequence (an index into `ends`) it continues, if any."""
    prompt = list(call.prompt_token_ids or [])
    result = CallDiagnosis(
        trajectory=t_index, call=c_index, sampled_tokens=len(call.completion_token_ids or [])
    )
    rendered = _render(tokenizer, call)
    result.template_matches = rendered == prompt if rendered is not None else None
    if result.template_matches is False:
        result.causes.append("template")
    sequences = [_sequence(calls[i]) for i in ends]
    for j in reversed(range(len(sequences))):  # the trainer's choice: the newest sequence the prompt extends
        if prompt[: len(sequences[j])] == sequences[j] and _temperature(calls[ends[j]]) == _temperature(call):
            first_turn = not any(m.get("role") == "assistant" for m in call.request_messages())
            result.continues, result.chained = ends[j], None if first_turn else True
            return result, j
    if not any(m.get("role") == "assistant" for m in call.request_messages()) or not sequences:
        return result, None  # a first turn: nothing sampled before it to continue
    shared = [_common_prefix(s, prompt) for s in sequences]
    best = max(range(len(sequences)), key=lambda i: (shared[i] / max(len(sequences[i]), 1), i))
    sequence, d = sequences[best], shared[best]
    result.continues, result.chained = ends[best], False
    result.diverge_at = d
    result.extra_context_tokens = min(len(prompt), len(sequence))
    result.sequence_window = _window(tokenizer, sequence, d)
    result.prompt_window = _window(tokenizer, prompt, d)
    if d == len(sequence):  # it extends that sequence's tokens, at another temperature
        result.causes.insert(0, "temperature")
    else:
        cause = _cause(tokenizer, calls[ends[best]], sequence, prompt, d)
        result.causes.insert(0, _reshaped(calls[ends[best]], call) if cause == "edited" else cause)
    return result, None


def _reshaped(previous: LLMCall, call: LLMCall) -> str:
    """Which way an agent's framework reshaped the history between two calls, from their requests."""
    if (previous.request_tools() or []) != (call.request_tools() or []):
        return "tools"
    before, after = previous.request_messages(), call.request_messages()
    if [m for m in before if m.get("role") == "system"] != [m for m in after if m.get("role") == "system"]:
        return "system"

    def key(m: dict[str, Any]) -> tuple[Any, str]:
        return m.get("role"), json.dumps(m.get("content"), sort_keys=True)

    sent = {key(m) for m in after}
    present = [key(m) in sent for m in before if m.get("role") != "system"]
    dropped = present.index(True) if True in present else len(present)
    if dropped and all(present[dropped:]):
        return "trimmed"  # the oldest messages went (a window, a summary), the rest stayed as they were
    return "edited"


def _cause(tokenizer: Any, previous: LLMCall, sequence: list[int], prompt: list[int], d: int) -> str:
    completion_start = len(previous.prompt_token_ids or [])
    if _truncated(previous):
        return "truncated"
    seq_text, prompt_text = _decode(tokenizer, sequence), _decode(tokenizer, prompt)
    if prompt_text.startswith(seq_text):  # same text, other tokens
        completion = list(previous.completion_token_ids or [])
        alone = tokenizer.encode(_decode(tokenizer, completion), add_special_tokens=False)
        return "boundary" if alone == completion or d < completion_start else "retokenized"
    c = _common_prefix(seq_text, prompt_text)
    turn_rest = seq_text[c:]
    prompt_turn = prompt_text[c:].split("<|im_end|>", 1)[0]
    if "</think>" in turn_rest and "</think>" not in prompt_turn:
        return "reasoning"
    opened, closed = seq_text.rfind("<tool_call>", 0, c + 1), seq_text.rfind("</tool_call>", 0, c + 1)
    if opened > closed and opened >= len(_decode(tokenizer, sequence[:completion_start])) - 1:
        return "arguments"
    if _squeezed(prompt_text).startswith(_squeezed(seq_text)):
        return "boundary"
    return "edited"


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _truncated(call: LLMCall) -> bool:
    if call.error:
        return True
    choices = call.choices()
    reason = choices[0].get("finish_reason") if choices else None
    return reason in (None, "length")


def _render(tokenizer: Any, call: LLMCall) -> list[int] | None:
    from .training.tokenize import chat_template_ids

    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return chat_template_ids(
            tokenizer,
            call.request_messages(),
            call.request_tools(),
            add_generation_prompt=call.request.get("add_generation_prompt", True),
            **(call.request.get("chat_template_kwargs") or {}),
        )
    except Exception:  # a template that cannot render this request is itself a mismatch
        return []


def _common_prefix(a: Any, b: Any) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def _window(tokenizer: Any, ids: list[int], at: int) -> str:
    before = _decode(tokenizer, ids[max(0, at - WINDOW) : at])
    after = _decode(tokenizer, ids[at : at + WINDOW])
    shown = f"{before}⟦{after}⟧" if at < len(ids) else f"{before}⟦end⟧"
    return shown.replace("\n", "\\n")


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories from a JSONL file (one per line, our format) or every *.jsonl file under a folder."""
    path = Path(path)
    if path.is_dir():
        return [t for file in sorted(path.rglob("*.jsonl")) for t in read_jsonl(file)]
    if not path.is_file():
        raise SystemExit(f"no such file or folder: {path}")
    return read_jsonl(path)


def render_report(report: DriftReport, *, console: Any = None) -> None:
    """A table of the calls that do not chain (or whose template differs) and a summary line."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="calls that do not continue their sequence", show_lines=True)
    for column in ("traj", "call", "after", "token", "sampled sequence", "prompt sent", "cause"):
        table.add_column(column, overflow="fold")
    for c in report.calls:
        if c.chained is False or c.template_matches is False:
            causes = "; ".join(CAUSES[x] for x in c.causes)
            after = "" if c.continues is None else str(c.continues)
            token = "" if c.diverge_at is None else str(c.diverge_at)
            table.add_row(
                str(c.trajectory), str(c.call), after, token, c.sequence_window, c.prompt_window, causes
            )
    if table.row_count:
        console.print(table)
    s = report.summary()
    console.print(
        f"{s['calls']} calls, {s['continuing_calls']} continue a conversation, {s['chained']} chain "
        f"(chaining rate {s['chaining_rate']:.3f}); {s['extra_context_tokens']} extra context tokens; "
        f"{s['template_mismatches']} prompt(s) the template does not reproduce"
    )


def doctor_command(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="art-adapters doctor", description=__doc__)
    parser.add_argument("trajectories", help="a trajectories JSONL file, or a folder of them")
    parser.add_argument("--model", required=True, help="the model folder (its tokenizer and chat template)")
    parser.add_argument("--json", action="store_true", help="print JSON (every call) instead of a table")
    args = parser.parse_args(argv)
    trajectories = load_trajectories(args.trajectories)  # a wrong path fails before the tokenizer loads
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    report = diagnose(trajectories, tokenizer)
    if args.json:
        print(json.dumps({"summary": report.summary(), "calls": [c.model_dump() for c in report.calls]}))
    else:
        render_report(report)
    return 0
