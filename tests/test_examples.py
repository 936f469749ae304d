"""The examples run: capture-only paths against ScriptedServer now; the training variants on the tiny model (LocalBackend)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from art_adapters.envs import SQLiteEnv
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(*args: str, timeout: float = 180, quiet: bool = False) -> str:
    """Run an example; `quiet`: its stderr must be empty (no library notes, no progress bar redrawn into a log)."""
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if quiet:
        assert done.stderr == "", done.stderr
    return done.stdout


def calculator(request: dict[str, Any]) -> Reply:
    a, b = map(int, re.findall(r"\d+", request["messages"][-1]["content"]))
    return Reply(content=str(a + b))


def test_quickstart_against_an_endpoint() -> None:
    with ScriptedServer(calculator) as server:
        out = run_example(
            str(EXAMPLES / "quickstart.py"),
            "--endpoint",
            server.base_url,
            "--steps",
            "2",
            "--groups",
            "2",
            "--group-size",
            "3",
        )
    assert out.splitlines() == ["step 0: reward 1.000", "step 1: reward 1.000"]
    assert len(server.requests) == 12


def test_langgraph_sql_agent_against_an_endpoint(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite"
    env = SQLiteEnv(db)
    answers = {s.question: s.answer for s in env.scenarios("train")}

    def responder(request: dict[str, Any]) -> Reply:
        messages = request["messages"]
        question = messages[1]["content"]
        tools_done = sum(m["role"] == "tool" for m in messages)
        if tools_done == 0:
            return Reply(tool_calls=[{"name": "describe_schema", "arguments": {}}])
        if tools_done == 1:
            return Reply(
                tool_calls=[{"name": "run_query", "arguments": {"sql": "SELECT COUNT(*) FROM customers"}}]
            )
        answer = answers[question]
        text = ", ".join(answer) if isinstance(answer, list) else str(answer)
        return Reply(content=f"Done.\nANSWER: {text}")

    out_file = tmp_path / "trajectories.jsonl"
    with ScriptedServer(responder) as server:
        out = run_example(
            str(EXAMPLES / "langgraph_sql_agent" / "train.py"),
            "--endpoint",
            server.base_url,
            "--db",
            str(db),
            "--steps",
            "1",
            "--scenarios",
            "3",
            "--group-size",
            "2",
            "--out",
            str(out_file),
            "--request-token-ids",
        )
    assert "step 0: reward 1.000 over 6 rollouts, 18 LLM calls" in out
    trajectories = read_jsonl(out_file)
    assert len(trajectories) == 6
    for trajectory in trajectories:
        roles = [m["role"] for m in trajectory.messages()]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert trajectory.messages()[5]["content"] == "COUNT(*)\n40"
        assert all(call.prompt_token_ids and call.completion_token_ids for call in trajectory.llm_calls)


def notes_responder(request: dict[str, Any]) -> Reply:
    messages = request["messages"]
    if messages[-1]["role"] == "tool":
        return Reply(content=messages[-1]["content"])
    if "Peru" in messages[1]["content"]:
        return Reply(tool_calls=[{"name": "read_note", "arguments": {"key": "capital-of-peru"}}])
    return Reply(tool_calls=[{"name": "add", "arguments": {"a": 19.5, "b": 22.5}}])


def test_openai_tool_agent_with_mcp_tools() -> None:
    with ScriptedServer(notes_responder) as server:
        out = run_example(
            str(EXAMPLES / "openai_tool_agent.py"),
            "--endpoint",
            server.base_url,
            "--mcp",
            f"{sys.executable} {EXAMPLES / 'mcp_server.py'}",
            "--scenarios",
            "2",
        )
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [{"reward": 1.0, "llm_calls": 2, "messages": 5}] * 4


def test_openai_tool_agent_on_sqlite(tmp_path: Path) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        if request["messages"][-1]["role"] == "tool":
            return Reply(content="ANSWER: 0")
        return Reply(tool_calls=[{"name": "run_query", "arguments": {"sql": "DROP TABLE orders"}}])

    with ScriptedServer(responder) as server:
        out = run_example(
            str(EXAMPLES / "openai_tool_agent.py"),
            "--endpoint",
            server.base_url,
            "--db",
            str(tmp_path / "shop.sqlite"),
            "--scenarios",
            "2",
            "--group-size",
            "1",
        )
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [{"reward": 0.0, "llm_calls": 2, "messages": 5}] * 2


@pytest.mark.train
def test_quickstart_trains_on_the_tiny_model(tmp_path: Path) -> None:
    from art_adapters.tiny import tiny_model_path

    out = run_example(
        str(EXAMPLES / "quickstart.py"),
        "--base-model",
        str(tiny_model_path()),
        "--steps",
        "2",
        "--groups",
        "2",
        "--group-size",
        "4",
        "--learning-rate",
        "1e-4",
        "--path",
        str(tmp_path),
        timeout=900,
        quiet=True,
    )
    assert re.findall(r"step (\d+): reward", out) == ["0", "1"]
    assert max(int(n) for n in re.findall(r"trained_tokens (\d+)", out)) > 0, out  # a step really trained
    assert (tmp_path / "quickstart" / "models" / "quickstart" / "checkpoints" / "0002").is_dir()


@pytest.mark.train
def test_langgraph_sql_agent_trains_on_the_tiny_model(tmp_path: Path) -> None:
    from art_adapters.tiny import tiny_model_path

    out = run_example(
        str(EXAMPLES / "langgraph_sql_agent" / "train.py"),
        "--base-model",
        str(tiny_model_path()),
        "--steps",
        "1",
        "--scenarios",
        "2",
        "--group-size",
        "2",
        "--max-steps",
        "4",
        "--path",
        str(tmp_path),
        "--db",
        str(tmp_path / "shop.sqlite"),
        timeout=900,
        quiet=True,
    )
    assert "step 0: reward" in out
    assert int(re.findall(r"trained_tokens (\d+)", out)[0]) > 0, out  # the step really trained


@pytest.mark.train
def test_planner_executor_trains_only_the_planner(tmp_path: Path) -> None:
    """Two steps on the tiny model: every trained token is a planner token the engine sampled; the executor's
    tokens are context (left out), and the step's trained tokens are exactly the planner's of groups that train."""
    from art_adapters.tiny import tiny_model_path

    out = run_example(
        str(EXAMPLES / "langgraph_planner_executor" / "train.py"),
        "--base-model",
        str(tiny_model_path()),
        "--steps",
        "2",
        "--max-tokens",
        "24",
        "--learning-rate",
        "1e-4",
        "--path",
        str(tmp_path),
        timeout=900,
        quiet=True,
    )
    steps = re.findall(
        r"trained_tokens (\d+) \(planner\), left_out_tokens (\d+) \(executor\), "
        r"sampled_token_fraction ([\d.]+)",
        out,
    )
    assert len(steps) == 2, out
    directory = tmp_path / "planner-executor" / "models" / "planner"
    history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
    for step, (trained, left_out, fraction) in enumerate(steps):
        assert float(fraction) == 1.0 and int(left_out) > 0
        trajectories = read_jsonl(directory / "trajectories" / "train" / f"{step:04d}.jsonl")
        nodes = {c.source.node for t in trajectories for c in t.llm_calls}
        assert nodes == {"planner", "executor"}
        executor = sum(
            len(c.completion_token_ids or [])
            for t in trajectories
            for c in t.llm_calls
            if c.source.node == "executor"
        )
        planner = sum(
            len(c.completion_token_ids or [])
            for t in trajectories
            for c in t.llm_calls
            if c.source.node == "planner"
        )
        assert int(left_out) == executor
        assert int(trained) == planner  # per-role planner rewards always differ (length tie-break): all train
        row = next(r for r in history if r["step"] == step)
        assert row["trained_tokens"] == int(trained) and row["sampled_token_fraction"] == 1.0
        assert all(t.metrics["sampled_token_fraction"] == 1.0 for t in trajectories if t.rewards_by_role)
    assert sum(int(t) for t, _, _ in steps) > 0
