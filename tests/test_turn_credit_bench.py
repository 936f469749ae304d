"""bench/turn_credit.py without vLLM: its rollout against a scripted OpenAI-compatible server (per-call rewards,
repaired mistakes, normalised tool calls so states repeat) and its paired summary on fixed rows."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import art_adapters as art
from art_adapters.testing import Reply, ScriptedServer

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(BENCH))
    import turn_credit

    yield turn_credit
    sys.modules.pop("turn_credit", None)


def chain_script(names: list[str]) -> Any:
    def script(request: dict[str, Any]) -> Reply:
        turn = sum(1 for m in request["messages"] if m["role"] == "assistant")
        if turn >= len(names):
            return Reply(content="done")
        return Reply(tool_calls=[{"name": names[turn], "arguments": {"x": turn}}])

    return script


@pytest.mark.parametrize(
    ("names", "rewards", "success"),
    [
        (["day", "query", "day", "capital"], [0.0, 1 / 3, 1 / 3, 1 / 3], 1.0),  # an early mistake, repaired
        (["query", "day", "capital"], [1 / 3] * 3, 1.0),
        (["fun", "fun", "fun", "fun", "fun"], [0.0] * 5, 0.0),  # out of turns
        (["query"], [1 / 3, 0.0], 0.0),  # then no tool call: the episode ends
    ],
)
async def test_rollout_rewards_each_call_and_the_chain(
    bench: ModuleType, names: list[str], rewards: list[float], success: float
) -> None:
    with ScriptedServer(chain_script(names), cycle=True) as server:
        model = art.Model(
            name="m", inference_base_url=server.base_url, inference_api_key="x", inference_model_name="m"
        )
        trajectory = await bench.rollout(model, bench.SCENARIOS[0], seed=1)
        last = server.requests[-1]["messages"]
    assert [c.reward for c in trajectory.llm_calls] == pytest.approx(rewards)
    assert trajectory.reward == success == trajectory.metrics["success"]
    sent = [m for m in last if m["role"] == "assistant"]
    # what goes back to the model is normalised (fixed ids, no arguments): the same choices, the same prompt
    assert all(m["tool_calls"][0]["id"] == f"call_{k}" for k, m in enumerate(sent))
    assert all(m["tool_calls"][0]["function"]["arguments"] == "{}" for m in sent)


def chain_rows(turn_curve: list[float], trajectory_curve: list[float]) -> list[dict[str, Any]]:
    rows = []
    for seed in range(3):
        rows.append({"seed": seed, "arm": "trajectory", "curve": trajectory_curve, "success": 0.5})
        rows.append({"seed": seed, "arm": "turn", "curve": turn_curve, "success": 0.5 + 0.1 * seed})
    return rows


def test_summary_pairs_seeds_and_counts_steps_to_reach(bench: ModuleType, capsys: Any) -> None:
    bench.summarize(chain_rows([0.2, 0.5, 0.6, 0.7], [0.0, 0.2, 0.4, 0.6]))
    out = capsys.readouterr().out
    # eval: diffs 0, 0.1, 0.2 (t with 2 df); last 3 steps: 0.6 - 0.4 every seed; all steps: 0.5 - 0.3; the trailing
    # 3-step mean of "turn" first reaches trajectory's final trailing mean (0.4) at step 3
    assert (
        "| turn | 0.600 (3 seeds) | +0.100 [-0.148, +0.348] | +0.200 [+0.200, +0.200] | +0.200 [+0.200, +0.200] "
        "| 3 (0.75x of 4) | 0 / 3 |" in out
    )
    assert "| trajectory | 0.500 (3 seeds) |" in out
    assert (
        "goal (the better of turn/GiGPO reaches it within 0.7x the steps): not met -- turn at 3 of 4" in out
    )


def test_steps_to_reach_does_not_look_ahead(bench: ModuleType) -> None:
    assert bench.steps_to_reach([0.0, 0.0, 0.9, 0.0], 0.3) == 3  # a centred window would say step 2
    assert bench.steps_to_reach([0.0, 0.1], 0.9) is None


def test_steps_to_reach_counts_a_tie_that_float_rounding_puts_one_ulp_below(bench: ModuleType) -> None:
    """The 6-seed rows: gigpo's trailing mean at step 9 equals trajectory's final (305/576 exactly), but the two
    float means differ in the last bit; a tie reaches the target."""
    target = bench.trailing([0.46875, 0.5677083333333334, 0.5520833333333334], 2)
    tied = [0.5260416666666666, 0.5104166666666666, 0.5520833333333334]
    assert bench.trailing(tied, 2) < target  # the float artefact the tolerance absorbs
    assert bench.steps_to_reach(tied, target) == 3
    assert bench.steps_to_reach(tied, target + 1 / 576) is None  # one rollout short is not a tie


def test_no_verdict_when_trajectory_did_not_learn(bench: ModuleType, capsys: Any) -> None:
    """A flat "trajectory" makes every arm "reach" its final at once: that is not an answer to the goal."""
    bench.summarize(chain_rows([0.16, 0.17, 0.15, 0.16], [0.16, 0.15, 0.17, 0.16]))
    out = capsys.readouterr().out
    assert "n/a: 'trajectory' did not learn" in out and "goal not decidable" in out
    assert "within 0.7x the steps): met" not in out


def test_load_rows_refuses_a_seed_twice_and_mixed_settings(bench: ModuleType, tmp_path: Path) -> None:
    row = {"seed": 0, "arm": "turn", "curve": [0.1], "success": 0.1, "settings": {"learning_rate": 1e-3}}
    (tmp_path / "a.json").write_text(json.dumps([row]))
    (tmp_path / "b.json").write_text(json.dumps({"commit": "x", "rows": [{**row, "seed": 1}]}))
    assert len(bench.load_rows([str(tmp_path / "a.json"), str(tmp_path / "b.json")])) == 2
    with pytest.raises(SystemExit, match="appears twice"):
        bench.load_rows([str(tmp_path / "a.json"), str(tmp_path / "a.json")])
    (tmp_path / "c.json").write_text(json.dumps([{**row, "seed": 2, "settings": {"learning_rate": 5e-4}}]))
    with pytest.raises(SystemExit, match="different settings"):
        bench.load_rows([str(tmp_path / "a.json"), str(tmp_path / "c.json")])


def calls_of(trajectory: Any) -> list[str]:
    return [
        call["function"]["name"]
        for m in trajectory.messages_and_choices
        if isinstance(m, dict) and m.get("role") == "assistant"
        for call in m.get("tool_calls") or []
    ]


def test_the_warm_start_calls_until_the_chain_completes_or_the_turns_run_out(bench: ModuleType) -> None:
    """Every example keeps calling (no example stops early, so the warm-started agent does too); right_rate=1 is the
    chain itself, and at 0.2 the right share sits between chance (1/4) and the chain."""
    assert {tuple(calls_of(t)) for t in bench.warm_start(16, seed=0, right_rate=1.0)} == {tuple(bench.CHAIN)}
    examples = bench.warm_start(400, seed=0, right_rate=0.2)
    complete = 0
    for trajectory in examples:
        names, done = calls_of(trajectory), 0
        for name in names:
            done += done < len(bench.CHAIN) and name == bench.CHAIN[done]
        assert done == len(bench.CHAIN) or len(names) == bench.MAX_TURNS
        assert done < len(bench.CHAIN) or names[-1] == bench.CHAIN[-1]  # stops at the chain's end
        complete += done == len(bench.CHAIN)
    assert 0.1 < complete / len(examples) < 0.6  # about 0.32 for p = 0.4 a call over 5 turns


def test_the_curves_plot_draws_each_arms_mean_success_and_progress(bench: ModuleType, tmp_path: Path) -> None:
    rows = chain_rows([0.2, 0.5, 0.6, 0.7], [0.0, 0.2, 0.4, 0.6])
    for row in rows:
        row["progress"] = [min(1.0, c + 0.2) for c in row["curve"]]
    path = tmp_path / "curves.png"
    bench.plot_curves(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
