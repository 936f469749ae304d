"""`art-adapters demo` end to end (its own vLLM server, warm start, GRPO steps on the LangGraph agent, the result
line, the report in a real browser), and the agent module's independence from this project."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from test_report import CHROMIUM, _Rendered, chromium

RESULT = re.compile(
    r"^demo result: success_start=(?P<start>\d+\.\d+) success_end=(?P<end>\d+\.\d+) "
    r"steps=(?P<steps>\d+) seconds=(?P<seconds>\d+\.\d+)$"
)
STEPS = 20  # the demo's own


def imported_modules(source: str) -> list[str]:
    """Every module an `import` or `from ... import` names, relative ones with their leading dots."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_the_agent_module_imports_nothing_from_art_adapters() -> None:
    spec = importlib.util.find_spec("art_adapters.demo.agent")  # where `art-adapters demo` imports it from
    assert spec is not None and spec.origin is not None
    names = imported_modules(Path(spec.origin).read_text())
    assert "langgraph.graph" in names and "langchain_openai" in names  # the parse sees its imports
    ours = [n for n in names if n.startswith(".") or n.split(".")[0] == "art_adapters"]
    assert ours == [], f"the demo's agent must be plain LangGraph code; it imports {ours}"
    # the check itself catches both spellings of importing the project
    assert imported_modules("from ..langgraph import wrap_rollout\nimport art_adapters.envs") == [
        "..langgraph",
        "art_adapters.envs",
    ]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    root = tmp_path_factory.mktemp("demo")
    command = [str(Path(sys.executable).parent / "art-adapters"), "demo", "--steps", str(STEPS)]
    command += ["--path", str(root / "art"), "--out", str(root / "success.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANGFUSE_")}  # Langfuse off: the default
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, root / "art" / "demo" / "models" / "order-agent"


@pytest.mark.vllm
@pytest.mark.train
@pytest.mark.timeout(
    1800
)  # the whole demo runs in this test's set-up: 3.5 min idle, about 6 on 2 shared cores
def test_demo_learns_and_ends_with_the_result_line(demo_run, tmp_path: Path) -> None:
    done, model_dir = demo_run
    lines = done.stdout.strip().splitlines()
    match = RESULT.match(lines[-1])
    assert match, lines[-5:]
    assert int(match["steps"]) == STEPS
    assert (model_dir.parent.parent.parent.parent / "success.png").stat().st_size > 0
    splits = Counter(
        json.loads(line)["split"] for line in (model_dir / "history.jsonl").read_text().splitlines()
    )
    assert splits == {
        "sft": 1,
        "train": STEPS,
    }  # the warm start and the steps (the evaluation: evaluation.html)
    # the learning bar of issue 41: from about chance (1 tool in 4) to 0.85 of the questions answered from the
    # database. Three runs of these settings here ended at 0.891-0.922 on the harness's evaluation (64 draws at
    # temperature 1, one draw 0.016); the learning rate's fall over the second half keeps a late step from
    # overshooting (at a constant rate one run fell to 0.125 at step 19). Other seeds: docs/getting-started.md
    assert float(match["start"]) <= 0.45 and float(match["end"]) >= 0.85, lines[-1]
    # the harness's verdict: the gain over the warm start with its paired interval, above zero
    verdict = next(line for line in lines if line.startswith("    success ") and " gain " in line)
    low = float(re.search(r"\[95 % CI ([+-]\d\.\d+),", verdict)[1])  # type: ignore[index]
    assert low > 0, verdict
    saved = json.loads((model_dir / "evaluation.json").read_text())  # the harness's result, as JSON
    assert [t["target"] for t in saved["targets"]] == ["step 1", f"step {STEPS + 1}"], saved["targets"]
    # where the time went, by phase, just before the result; where to look just before that
    assert lines[-2].startswith("time: tiny model") and "GRPO steps" in lines[-2], lines[-2]
    assert lines[-5].startswith(f"report: {model_dir / 'report.html'}  (open it in a browser"), lines[-5]
    assert lines[-4].startswith(f"evaluation: {model_dir / 'evaluation.html'}"), lines[-4]
    assert lines[-3].startswith("Langfuse: off (set LANGFUSE_PUBLIC_KEY"), lines[-3]
    # only our own lines: no library's import notes (torchao's extensions, torch's pytree deprecation), and no
    # progress bar redrawn into a log (stderr is not a terminal here)
    assert done.stderr.strip() == "", done.stderr[-3000:]


@pytest.mark.vllm
@pytest.mark.train
@pytest.mark.timeout(1800)  # the demo's run when this test runs alone
@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (CI installs it: apt-get install -y chromium)"
)
def test_the_demos_report_shows_the_agents_tool_calls_in_a_browser(demo_run) -> None:
    _, model_dir = demo_run
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", (model_dir / "report.html").as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Rendered()
    parsed.feed(dom.stdout)
    assert parsed.rendered, "the trajectory browser script did not run"
    assert parsed.points["reward"] == STEPS  # the reward curve: one point per GRPO step
    assert parsed.buttons == 24  # the last step's rollouts (the first 24 of 64)
    # the trajectory shown first: the last step's first rollout, as the demo saved it
    last = sorted((model_dir / "trajectories" / "train").glob("*.jsonl"))[-1]
    shown = json.loads(last.read_text().splitlines()[0])
    messages = [m.get("message", m) for m in shown["messages_and_choices"]]  # a Choice carries its message
    text = "".join(parsed.viewer_text)
    question = next(m for m in messages if m["role"] == "user")["content"]
    assert question in text
    called = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert called["name"] in {"day", "name", "object", "result"} and '"order_id"' in called["arguments"]
    assert f"{called['name']}({called['arguments']})" in text  # the agent's tool call ...
    result = next(m for m in messages if m["role"] == "tool")["content"]
    assert result in text  # ... the database's result, as the agent's ToolNode returned it ...
    assert f"reward {shown['reward']:g}" in text  # ... and the reward


def test_getting_started_shows_the_agent_module_as_it_is() -> None:
    """The tutorial's copy of the agent is the file the demo trains (docs/getting-started.md stays true)."""
    spec = importlib.util.find_spec("art_adapters.demo.agent")
    assert spec is not None and spec.origin is not None
    page = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", page, flags=re.MULTILINE | re.DOTALL)
    agent = Path(spec.origin).read_text()
    assert agent in blocks, (
        "docs/getting-started.md: the agent block differs from src/art_adapters/demo/agent.py"
    )


def test_where_to_look_names_the_report_and_langfuse_only_when_set(monkeypatch, tmp_path: Path) -> None:
    """Langfuse is off unless LANGFUSE_* is set; when set, the demo's rollouts go there as traces (a real local
    stand-in for Langfuse's API, through the real SDK) and the last lines say where."""
    pytest.importorskip("langfuse")
    from art_adapters.demo.run import langfuse_exporter, where_to_look
    from art_adapters.testing.langfuse_api import LangfuseAPIServer
    from art_adapters.trajectories import Trajectory, TrajectoryGroup

    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_BASE_URL", "LANGFUSE_HOST"):
        monkeypatch.delenv(name, raising=False)
    report = tmp_path / "report.html"
    assert langfuse_exporter() is None
    lines = where_to_look(report, None)
    assert lines[0].startswith(f"report: {report}") and lines[1].startswith("Langfuse: off (set LANGFUSE_")
    with LangfuseAPIServer(public_key="pk", secret_key="sk") as server:
        monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk")
        monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk")
        monkeypatch.setenv("LANGFUSE_BASE_URL", server.base_url)
        exporter = langfuse_exporter()
        assert exporter is not None and exporter.client is not None
        question = {"role": "user", "content": "Who placed order 11?"}
        exporter.after_each(TrajectoryGroup([Trajectory(messages_and_choices=[question], reward=1.0)]))
        exporter.close(timeout_s=20.0)
        assert server.wait_for(traces=1)
        assert where_to_look(report, exporter)[1] == (
            f"Langfuse: 1 traces in {server.base_url}, session {exporter.session_id}"
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_warm_start_calls_each_tool_equally_often_for_every_question(tmp_path: Path, seed: int) -> None:
    """No tool favoured for any question, whatever the seed: independent draws gave the asked tool 7 to 17 of 64."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from art_adapters.demo.agent import SYSTEM, order_tools
    from art_adapters.demo.orders import questions, warm_start_examples
    from art_adapters.envs.sqlite import build_database

    db = build_database(tmp_path / "shop.sqlite", seed=seed)
    tools = [convert_to_openai_tool(t) for t in order_tools(db)]
    calls: dict[str, Counter[str]] = {}
    for example in warm_start_examples(db, tools, SYSTEM, 64, seed):
        question, call = example.messages_and_choices[1]["content"], example.messages_and_choices[2]
        calls.setdefault(question, Counter())[call["tool_calls"][0]["function"]["name"]] += 1
    assert set(calls) == {q.text for q in questions(db, seed)}
    assert all(counts == dict.fromkeys(counts, 2) and len(counts) == 4 for counts in calls.values()), calls


def test_the_demos_rate_holds_then_falls_to_a_tenth_and_bad_settings_are_refused() -> None:
    import asyncio

    from art_adapters.demo.run import run_demo, step_rate

    rates = [step_rate(k, 20, 1.0, 0.5) for k in range(20)]
    assert rates[:10] == [1.0] * 10 and rates[-1] == pytest.approx(0.1)
    assert all(
        a > b for a, b in zip(rates[10:], rates[11:], strict=False)
    )  # falling every step after the half
    assert [step_rate(k, 20, 1.0, None) for k in (0, 19)] == [1.0, 1.0]
    with pytest.raises(ValueError, match="async demo trains at one constant rate"):
        asyncio.run(run_demo(async_mode=True))
    with pytest.raises(ValueError, match="decay_start must be a share of the run"):
        asyncio.run(run_demo(decay_start=1.5))
