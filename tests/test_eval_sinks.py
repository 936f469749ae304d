"""Where an evaluation's result goes: the printed table, the report's evaluation page (rendered in headless
Chromium), W&B metrics (the real SDK, offline) and Langfuse dataset runs (the real SDK against the local API
stand-in)."""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from art_adapters.evaluation.sinks import log_langfuse, log_wandb, metric_label, write_report_section
from art_adapters.evaluation.table import format_table, shown_ks
from art_adapters.report import write_report
from eval_fixtures import HOSTILE, eval_result
from test_report import CHROMIUM, chromium


def test_table_rows_per_target_and_comparison() -> None:
    result = eval_result()
    text = format_table(result)
    lines = text.splitlines()
    assert lines[0].startswith("Evaluation of agent-001 (project demo, split val): 4 attempt(s) per scenario")
    assert "sampling temperature=0.7, max_tokens=256" in lines[0] and "seed" not in lines[0]
    assert "not held out" not in text
    header = next(line for line in lines if line.startswith("| target"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "target", "scenarios", "errors", "reward [95% CI]", "success", "pass@1", "pass@2", "pass@3", "pass@4",
    ]  # fmt: skip
    step12 = next(line for line in lines if line.startswith("| step 12 "))
    cells = [c.strip() for c in step12.strip("|").split("|")]
    summary = result.target("step 12")
    assert cells[1:3] == ["6", "1"]  # scenarios, errors
    assert cells[3] == f"{summary.reward.mean:.3f} [{summary.reward.low:.3f}, {summary.reward.high:.3f}]"
    assert cells[5] == f"{summary.pass_at_k[1]:.3f}"
    gain = next(line for line in lines if line.startswith("| step 12 vs step 0"))
    cells = [c.strip() for c in gain.strip("|").split("|")]
    comparison = result.comparisons[0]
    assert (
        cells[1] == f"{comparison.diff.mean:+.3f} [{comparison.diff.low:+.3f}, {comparison.diff.high:+.3f}]"
    )
    assert cells[2:] == ["3", "3", "0"]  # s2, s3, s4 improved; s0, s1, s5 the same


def test_table_warns_when_not_held_out_and_abbreviates_many_ks() -> None:
    text = format_table(eval_result(held_out=False))
    assert "WARNING: not held out: 2 evaluated scenario(s) were used in training (s0, s2)" in text
    many = eval_result(attempts=12, scenarios=1)
    header = next(line for line in format_table(many).splitlines() if line.startswith("| target"))
    assert [c.strip() for c in header.strip("|").split("|")][5:] == [
        "pass@1",
        "pass@2",
        "pass@4",
        "pass@8",
        "pass@12",
    ]
    assert "0.750 [n/a]" in format_table(many)  # one scenario: no interval to give
    assert shown_ks([1, 2, 3]) == [1, 2, 3] and shown_ks(range(1, 21)) == [1, 2, 4, 8, 16, 20]


class _Page(HTMLParser):
    """Chart points per chart, reference lines, tags seen, and the text of the attempts section."""

    def __init__(self) -> None:
        super().__init__()
        self.points: dict[str, list[dict[str, str | None]]] = {}
        self.refs: list[str | None] = []
        self.chart: str | None = None
        self.tags: dict[str, int] = {}
        self.stack: list[str] = []
        self.attempts_text: list[str] = []
        self.title: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "svg":
            self.chart = a.get("data-metric")
            self.points[self.chart or ""] = []
        if tag == "circle" and a.get("class") == "point" and self.chart is not None:
            self.points[self.chart].append(a)
        if tag == "line" and a.get("class") == "ref":
            self.refs.append(a.get("data-target"))
        self.stack.append(a.get("id") or tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.chart = None
        while self.stack:
            if self.stack.pop() in (tag,) or tag in ("svg",):
                break

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "line" and dict(attrs).get("class") == "ref":
            self.refs.append(dict(attrs).get("data-target"))

    def handle_data(self, data: str) -> None:
        if "attempts" in self.stack:
            self.attempts_text.append(data)
        if self.stack and self.stack[-1] == "title" and "head" in self.stack:
            self.title.append(data)


def _parse(page: str) -> _Page:
    parsed = _Page()
    parsed.feed(page)
    return parsed


def test_report_page_is_self_contained_escaped_and_linked(tmp_path: Path) -> None:
    result = eval_result(held_out=False)
    path = write_report_section(result, tmp_path / "run")
    assert path == tmp_path / "run" / "evaluation.html"
    page = path.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert HOSTILE not in page and "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    parsed = _parse(page)
    assert parsed.tags.get("img", 0) == 0 and parsed.tags.get("script", 0) == 0
    assert [p["data-target"] for p in parsed.points["reward"]] == ["step 0", "step 12"]
    assert float(parsed.points["reward"][1]["data-value"] or "nan") == pytest.approx(
        result.target("step 12").reward.mean
    )
    assert parsed.refs == ["gpt-ref"]  # a reference model is a dashed line, not a step
    assert len(parsed.points["pass@k"]) == 3 * 4  # three targets, k = 1..4
    assert 'id="not-held-out"' in page and "s0, s2" in page
    assert 'href="report.html"' not in page  # no training report beside it yet
    report = write_report(tmp_path / "run")  # the training report, written later, links the page
    assert 'id="evaluation-link" href="evaluation.html"' in report.read_text()
    again = write_report_section(eval_result(), tmp_path / "run")
    assert 'href="report.html"' in again.read_text() and 'id="not-held-out"' not in again.read_text()


def test_report_page_and_table_survive_a_target_that_never_finished(tmp_path: Path) -> None:
    import dataclasses

    from art_adapters.evaluation.intervals import Interval

    result = eval_result()
    nan = float("nan")
    result.targets[1] = dataclasses.replace(
        result.targets[1], scenarios=0, reward=Interval(nan, nan, nan), success_rate=None, pass_at_k={}
    )
    page = write_report_section(result, tmp_path).read_text()
    parsed = _parse(page)
    assert [p["data-target"] for p in parsed.points["reward"]] == ["step 0"]
    assert "nan" not in "".join(str(p) for p in parsed.points["reward"])
    assert "| step 12 | 0 | 1 | n/a [n/a] | n/a |" in " ".join(format_table(result).split())


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (CI installs it: apt-get install -y chromium)"
)
def test_report_page_renders_in_headless_chromium_with_tool_calls(tmp_path: Path) -> None:
    result = eval_result()
    path = write_report_section(result, tmp_path)
    dom = chromium("--virtual-time-budget=3000", "--dump-dom", path.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _parse(dom.stdout)
    assert "".join(parsed.title) == "demo/agent-001 — evaluation (val)"  # the hostile script never ran
    assert parsed.tags.get("img", 0) == 0
    text = "".join(parsed.attempts_text)
    assert '→ lookup({"q": "s2"})' in text and "facts about s2" in text  # tool call and its result
    assert HOSTILE in text  # shown as text
    assert "step 12 · attempt 0 · reward n/a" in text and "TimeoutError: rollout took over 60 s" in text
    assert len(parsed.points["reward"]) == 2 and len(parsed.points["pass@k"]) == 12
    shot = tmp_path / "evaluation.png"
    done = chromium("--hide-scrollbars", "--window-size=1280,1400", f"--screenshot={shot}", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_wandb_metrics_in_an_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from test_wandb import read_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = eval_result()
    run = wandb.init(project="art-eval-test", name="eval")
    run.log({"train/loss": 1.0}, step=11)
    logged = log_wandb(result, run, step=12)
    run_dir = Path(run.dir).parent
    run.finish()
    run_file = next(run_dir.glob("*.wandb"))
    deadline = time.monotonic() + 15  # wandb-core may still be writing the log's last block
    while len(rows := read_history(run_file)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    row = {r["_step"]: r for r in rows}[12]
    step12 = result.target("step 12")
    assert row["eval/step_12/reward"] == pytest.approx(step12.reward.mean)
    assert row["eval/step_12/reward_ci_low"] == pytest.approx(step12.reward.low)
    assert row["eval/step_12/reward_ci_high"] == pytest.approx(step12.reward.high)
    assert row["eval/step_12/success_rate"] == pytest.approx(step12.success_rate)
    assert row["eval/step_12/pass@2"] == pytest.approx(step12.pass_at_k[2])
    assert row["eval/step_12/errors"] == 1 and row["eval/gpt-ref/reward"] == pytest.approx(1.0)
    gain = result.comparisons[0]
    assert row["eval/step_12_vs_step_0/diff"] == pytest.approx(gain.diff.mean)
    assert row["eval/step_12_vs_step_0/diff_ci_low"] == pytest.approx(gain.diff.low)
    assert row["eval/step_12_vs_step_0/improved"] == 3 and row["eval/step_12_vs_step_0/worse"] == 0
    assert row["eval/held_out"] == 1
    assert {k for k in row if k.startswith("eval/")} == set(logged)


def test_wandb_skips_undefined_bounds_and_follows_a_wandb_logger() -> None:
    result = eval_result(scenarios=1)
    assert math.isnan(result.target("step 0").reward.low)

    class Run:
        def __init__(self) -> None:
            self.rows: list[tuple[dict[str, float], int | None]] = []

        def log(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((metrics, step))

    class Logger:  # WandbLogger's shape: a `run` (None when W&B is disabled) and log_step
        def __init__(self, run: Run | None) -> None:
            self.run = run

        def log_step(self, step: int, metrics: dict[str, Any]) -> None: ...

    run = Run()
    logged = log_wandb(result, Logger(run))
    assert run.rows == [(logged, None)]
    assert "eval/step_0/reward" in logged and "eval/step_0/reward_ci_low" not in logged
    assert log_wandb(result, Logger(None)) == logged  # W&B disabled: nothing logged, nothing raised
    with pytest.raises(TypeError, match="wandb Run or a WandbLogger"):
        log_wandb(result, object())
    assert metric_label("openai/gpt-4o mini") == "openai_gpt-4o_mini"


@pytest.fixture
def langfuse_server() -> Any:
    pytest.importorskip("langfuse")
    from art_adapters.testing.langfuse_api import LangfuseAPIServer

    public, secret = f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


def test_langfuse_dataset_runs_per_target_with_a_scored_trace_per_attempt(langfuse_server: Any) -> None:
    from langfuse import Langfuse

    client = Langfuse(
        public_key=langfuse_server.public_key,
        secret_key=langfuse_server.secret_key,
        base_url=langfuse_server.base_url,
    )
    result = eval_result()
    scenarios = {f"s{i}": {"question": f"Question s{i}?", "note": HOSTILE} for i in range(6)}
    runs = log_langfuse(result, client, scenarios=scenarios)
    assert runs is not None and runs.dataset == "demo/agent-001/val"
    assert runs.runs == {
        "step 0": "agent-001 step 0",
        "step 12": "agent-001 step 12",
        "gpt-ref": "agent-001 gpt-ref",
    }
    assert len(runs.trace_ids) == len(result.attempts) == 72

    dataset = client.get_dataset("demo/agent-001/val")  # read back through the SDK
    assert sorted(i.metadata["scenario_id"] for i in dataset.items) == sorted(scenarios)
    assert {i.id: i.input for i in dataset.items} == {runs.item_ids[s]: v for s, v in scenarios.items()}

    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    experiments = client.api.experiments.list(from_start_time=since, dataset_id=dataset.id).data
    assert sorted(e.name for e in experiments) == sorted(runs.runs.values())
    assert all(e.item_count == 24 for e in experiments)
    assert {e.name: e.id for e in experiments} == {runs.runs[t]: i for t, i in runs.experiment_ids.items()}

    items: list[Any] = []
    cursor = None
    for _ in range(10):  # cursor pages of 10
        page = client.api.experiments.list_items(
            from_start_time=since,
            experiment_name="agent-001 step 12",
            fields="core,dataset,io,itemMetadata,scores",
            limit=10,
            cursor=cursor,
        )
        items += page.data
        cursor = page.meta.cursor
        if not cursor:
            break
    assert len(items) == 24
    by_key = {
        (i.experiment_item_metadata["scenario_id"], i.experiment_item_metadata["attempt"]): i for i in items
    }
    for attempt in (a for a in result.attempts if a.target == "step 12"):
        item = by_key[(attempt.scenario_id, attempt.attempt)]
        assert item.experiment_item_id == runs.item_ids[attempt.scenario_id]  # linked to its dataset item
        assert item.experiment_dataset_id == dataset.id
        assert item.trace_id == runs.trace_ids[("step 12", attempt.scenario_id, attempt.attempt)]
        assert item.input == scenarios[attempt.scenario_id]
        scores = {s.name: s.value for s in item.scores or []}
        if attempt.error is not None:
            assert item.level.value == "ERROR" and scores == {}
            assert item.output["error"] == attempt.error
            continue
        assert scores == {"reward": attempt.reward, "success": attempt.success}
        assert item.output[-1] == {"role": "assistant", "content": attempt.messages[-1]["message"]["content"]}
        if attempt.scenario_id != "s5":
            assert item.output[0]["tool_calls"][0]["function"]["name"] == "lookup"
            assert item.output[1] == {
                "role": "tool",
                "tool_call_id": f"call_{attempt.scenario_id}",
                "content": f"facts about {attempt.scenario_id}",
            }
    client.shutdown()


def test_langfuse_through_an_exporter_items_default_to_the_prompt_and_no_keys_log_nothing(
    langfuse_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from art_adapters.evaluation.results import Attempt
    from art_adapters.tracing.langfuse import LangfuseExporter

    exporter = LangfuseExporter(
        langfuse_server.public_key, langfuse_server.secret_key, langfuse_server.base_url
    )
    result = eval_result(scenarios=2, attempts=1)
    result.attempts.append(Attempt("step 0", "lost", 0, None, None, "ValueError: bad output", [], 0.1))
    runs = log_langfuse(result, exporter, dataset_name="my-eval")
    assert runs is not None and runs.dataset == "my-eval" and len(runs.trace_ids) == 7
    items = {i.metadata["scenario_id"]: i.input for i in exporter.client.get_dataset("my-eval").items}
    assert items["s0"] == [
        {"role": "system", "content": "Answer with the tool."},
        {"role": "user", "content": "Question s0?"},
    ]
    assert items["lost"] == {"scenario_id": "lost"}  # every attempt errored: no prompt to show
    exporter.close()

    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("LANGFUSE_SECRET_KEY", raising=False)
    with pytest.warns(RuntimeWarning, match="disabled"):
        disabled = LangfuseExporter()
    assert log_langfuse(result, disabled) is None
    disabled.close()
    with pytest.raises(TypeError, match="langfuse.Langfuse or a LangfuseExporter"):
        log_langfuse(result, object())


def test_langfuse_logs_only_the_targets_asked_for(langfuse_server: Any) -> None:
    from langfuse import Langfuse

    client = Langfuse(
        public_key=langfuse_server.public_key,
        secret_key=langfuse_server.secret_key,
        base_url=langfuse_server.base_url,
    )
    result = eval_result(scenarios=2, attempts=2)
    with pytest.raises(ValueError, match=r"no target\(s\) \['step 99'\]"):
        log_langfuse(result, client, targets=["step 99"])
    assert langfuse_server.datasets.datasets == {}  # refused before writing anything
    runs = log_langfuse(result, client, targets=["step 12"])
    assert runs is not None and list(runs.runs) == ["step 12"] and len(runs.trace_ids) == 4
    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    assert [e.name for e in client.api.experiments.list(from_start_time=since).data] == ["agent-001 step 12"]
    client.shutdown()
