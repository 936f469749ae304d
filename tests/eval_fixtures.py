"""EvalResult fixtures for the evaluation's sinks and table: attempts with tool calls, an errored attempt, hostile
text, summarised with the real statistics (art_adapters.evaluation.stats)."""

from __future__ import annotations

import statistics
from typing import Any

from art_adapters.evaluation.results import Attempt, Comparison, EvalResult, TargetSummary
from art_adapters.evaluation.stats import compare, mean_ci, paired_diff_ci, pass_at_k

HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def conversation(scenario: str, answer: str, *, tool: bool = True) -> list[dict[str, Any]]:
    """A tool-using conversation: the question, a `lookup` call, its result, the answer (a Choice-shaped last turn)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer with the tool."},
        {"role": "user", "content": f"Question {scenario}?"},
    ]
    if tool:
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{scenario}",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": f'{{"q": "{scenario}"}}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"call_{scenario}", "content": f"facts about {scenario}"},
        ]
    messages.append(
        {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": answer}}
    )
    return messages


def summarise(
    label: str, step: int | None, attempts: list[Attempt], k_max: int
) -> tuple[TargetSummary, dict[str, float]]:
    by_scenario: dict[str, list[Attempt]] = {}
    for a in attempts:
        by_scenario.setdefault(a.scenario_id, []).append(a)
    means = {
        sid: statistics.fmean(a.reward for a in rows if a.reward is not None)
        for sid, rows in by_scenario.items()
        if any(a.reward is not None for a in rows)
    }
    finished = [a for a in attempts if a.error is None]
    pass_k: dict[int, float] = {}
    for k in range(1, k_max + 1):
        values = []
        for rows in by_scenario.values():
            done = [a for a in rows if a.error is None]
            if len(done) >= k:
                values.append(pass_at_k(len(done), sum(bool(a.success) for a in done), k))
        if values:
            pass_k[k] = statistics.fmean(values)
    summary = TargetSummary(
        target=label,
        step=step,
        scenarios=len(means),
        errors=sum(a.error is not None for a in attempts),
        reward=mean_ci(list(means.values())),
        success_rate=statistics.fmean(bool(a.success) for a in finished),
        pass_at_k=pass_k,
    )
    return summary, means


def eval_result(*, held_out: bool = True, attempts: int = 4, scenarios: int = 6) -> EvalResult:
    """step 0 solves scenarios s0 and s1; step 12 also solves s2..s4 (s5 stays hard); reference solves all.
    Step 12's first attempt at s3 errored; s1's answers carry hostile HTML."""
    ids = [f"s{i}" for i in range(scenarios)]
    solved = {"step 0": {"s0", "s1"}, "step 12": {"s0", "s1", "s2", "s3", "s4"}, "gpt-ref": set(ids)}
    steps = {"step 0": 0, "step 12": 12, "gpt-ref": None}
    rows: list[Attempt] = []
    for label in solved:
        for sid in ids:
            for n in range(attempts):
                good = sid in solved[label] and (n % 4 != 3 or label == "gpt-ref")
                answer = HOSTILE if sid == "s1" else f"answer {sid} by {label} #{n}"
                if label == "step 12" and sid == "s3" and n == 0:
                    rows.append(
                        Attempt(label, sid, n, None, None, "TimeoutError: rollout took over 60 s", [], 60.0)
                    )
                    continue
                rows.append(
                    Attempt(
                        target=label,
                        scenario_id=sid,
                        attempt=n,
                        reward=1.0 if good else 0.0,
                        success=good,
                        error=None,
                        messages=conversation(sid, answer, tool=sid != "s5"),
                        seconds=0.5 + n,
                    )
                )
    summaries, means = [], {}
    for label, step in steps.items():
        summary, per_scenario = summarise(label, step, [a for a in rows if a.target == label], attempts)
        summaries.append(summary)
        means[label] = per_scenario
    comparisons = []
    for a, b in (("step 0", "step 12"), ("step 12", "gpt-ref")):
        common = [sid for sid in means[a] if sid in means[b]]
        comparisons.append(
            Comparison(
                a=a,
                b=b,
                diff=paired_diff_ci([means[a][s] for s in common], [means[b][s] for s in common]),
                changes=compare(means[a], means[b]),
            )
        )
    return EvalResult(
        model="agent-001",
        project="demo",
        split="val",
        attempts_per_scenario=attempts,
        sampling={"temperature": 0.7, "max_tokens": 256, "seed": None},
        held_out=held_out,
        not_held_out_ids=[] if held_out else ["s0", "s2"],
        targets=summaries,
        comparisons=comparisons,
        attempts=rows,
    )
