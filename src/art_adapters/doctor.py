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
    "edited": "the history sent differs from what was sampled (the agent edited, dropped or reordered messages)",
    "template": "a different template or tokenizer: the model folder's chat template does not render this "
    "request to the ids the engine saw",
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
    """Diagnose every captured call of `trajectories` (those with engine token ids) against `tokenizer`."""
    out: list[CallDiagnosis] = []
    for t_index, trajectory in enumerate(trajectories):
        calls = [c for c in trajectory.llm_calls if c.prompt_token_ids and c.completion_token_ids is not None]
        for c_index, call in enumerate(calls):
            out.append(_diagnose_call(t_index, c_index, call, calls[:c_index], tokenizer))
    return DriftReport(calls=out)


def _diagnose_call(
    t_index: int, c_index: int, call: LLMCall, earlier: list[LLMCall], tokenizer: Any
) -> CallDiagnosis:
    prompt = list(call.prompt_token_ids or [])
    result = CallDiagnosis(
        trajectory=t_index, call=c_index, sampled_tokens=len(call.completion_token_ids or [])
    )
    rendered = _render(tokenizer, call)
    result.template_matches = rendered == prompt if rendered is not None else None
    if result.template_matches is False:
        result.causes.append("template")
    if not any(m.get("role") == "assistant" for m in call.request_messages()) or not earlier:
        return result  # a first turn: nothing sampled before it to continue
    sequences = [list(c.prompt_token_ids or []) + list(c.completion_token_ids or []) for c in earlier]
    shared = [_common_prefix(s, prompt) for s in sequences]
    best = max(range(len(sequences)), key=lambda i: (shared[i] / max(len(sequences[i]), 1), i))
    sequence, d = sequences[best], shared[best]
    result.continues = best
    result.chained = d == len(sequence)
    if result.chained:
        return result
    result.diverge_at = d
    result.extra_context_tokens = min(len(prompt), len(sequence))
    result.sequence_window = _window(tokenizer, sequence, d)
    result.prompt_window = _window(tokenizer, prompt, d)
    result.causes.insert(0, _cause(tokenizer, earlier[best], sequence, prompt, d))
    return result


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
