"""Per-agent adapters in the run's record: the HTML report's per-agent view (each agent's step metrics as the
per-agent trainer wrote them, and which adapter and version served each saved call; in the browser, each call names
its adapter) and each Langfuse generation's adapter (the real langfuse SDK against tests/langfuse_receiver.py)."""

from __future__ import annotations

import re
import uuid
from html.parser import HTMLParser
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.model_log import all_trajectories
from art_adapters.report import write_report
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from test_per_agent_training import CONFIG, LORA, groups_of
from test_report import CHROMIUM, chromium

pytestmark = pytest.mark.train
AGENTS = ("planner", "executor")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float], list[art.TrajectoryGroup]]:
    """A per-agent run's folder as LocalBackend writes it: one real step of the per-agent trainer, its history row
    and trajectories; each call served by its agent's adapter at version 0 (as the gateway records it), except
    one served by the shared adapter."""
    trainer = PerAgentTrainer(tiny_model_path(), LORA, per_agent=art.PerAgent(by="role", agents=list(AGENTS)))
    groups = groups_of(trainer, list(AGENTS))
    for group in groups:
        for trajectory in group.trajectories:
            for call in trajectory.llm_calls:
                call.served_model, call.policy_version = f"rep/team.{call.source.role}@0", 0
    groups[0].trajectories[0].llm_calls[0].served_model = "rep/team@0"
    metrics = trainer.train_step(groups, CONFIG)
    folder = tmp_path_factory.mktemp("art") / "rep/models/team"
    checkpoints.write_trajectories(folder, "train", 0, all_trajectories(groups))
    checkpoints.append_history(folder, {**metrics, "step": 0, "split": "train"})
    return folder, metrics, groups


class Tables(HTMLParser):
    """The rows of each table with an id: {table id: [[cell text, ...], ...]}."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.table: str | None = None
        self.cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.table = dict(attrs).get("id")
            self.tables.setdefault(self.table or "", [])
        elif tag == "tr" and self.table is not None:
            self.tables[self.table].append([])
        self.cell = tag == "td"

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.table = None

    def handle_data(self, data: str) -> None:
        if self.cell and self.table is not None:
            self.tables[self.table][-1].append(data)


def test_the_report_has_a_per_agent_view_of_metrics_and_served_adapters(run) -> None:
    folder, metrics, groups = run
    page = write_report(folder).read_text()
    parsed = Tables()
    parsed.feed(page)
    steps = {row[1]: row for row in parsed.tables["agent-steps"] if row}
    assert set(steps) == set(AGENTS)  # the shared adapter had no calls of its own
    for agent in AGENTS:  # step, agent, loss, trained_tokens, grad_norm, reward_mean, trajectories
        _, _, loss, tokens, norm, reward, trajectories = steps[agent]
        assert int(tokens) == metrics[f"agent/{agent}/trained_tokens"] > 0
        assert float(loss) == pytest.approx(metrics[f"agent/{agent}/loss"], rel=1e-3)
        assert float(norm) == pytest.approx(metrics[f"agent/{agent}/grad_norm"], rel=1e-3)
        assert float(reward) == pytest.approx(metrics[f"agent/{agent}/reward_mean"], rel=1e-3)
        assert int(trajectories) == metrics[f"agent/{agent}/trajectories"]
    calls = sum(len(g.trajectories) for g in groups)  # each trajectory: one call per agent
    served = {row[2]: row for row in parsed.tables["agent-calls"] if row}
    assert served == {
        "executor": ["train", "0", "executor", "0", str(calls)],
        "planner": ["train", "0", "planner", "0", str(calls - 1)],
        "shared": ["train", "0", "shared", "0", "1"],
    }
    assert '"adapter": "planner"' in page and '"served_model": "rep/team.planner@0"' in page


def test_a_run_without_per_agent_adapters_has_no_per_agent_view(tmp_path: Path) -> None:
    folder = tmp_path / "p/models/solo"
    call = art.LLMCall(request={}, served_model="p/solo@2", policy_version=2)
    checkpoints.write_trajectories(folder, "train", 2, [art.Trajectory(llm_calls=[call])])
    checkpoints.append_history(folder, {"step": 2, "loss": 0.5})
    page = write_report(folder).read_text()
    assert 'id="agents"' not in page and '"adapter": "shared"' in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_each_call_in_the_browser_names_its_adapter(run, tmp_path: Path) -> None:
    folder, _, _ = run
    out = write_report(folder, tmp_path / "report.html")
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    viewer = dom.stdout[dom.stdout.index('id="viewer"') :]
    headers = re.findall(r"<h4>(call \d+: [^<]*)</h4>", viewer)
    assert "adapter shared (rep/team@0)" in headers[0], headers  # the first trajectory: its first call shared
    assert "adapter executor (rep/team.executor@0)" in headers[1], headers


def test_each_langfuse_generation_carries_its_adapter(run) -> None:
    pytest.importorskip("langfuse")
    from art_adapters.tracing.langfuse import LangfuseExporter
    from langfuse_receiver import LangfuseReceiver

    _, _, groups = run
    trajectory = groups[0].trajectories[1]  # a planner call then an executor call
    with LangfuseReceiver("ok") as receiver:
        exporter = LangfuseExporter(f"pk-{uuid.uuid4().hex[:12]}", "sk", receiver.base_url)
        (trace_id,) = exporter.export([trajectory], step=0)
        assert exporter.flush(10)
        exporter.close()
        generations = sorted(receiver.observations(trace_id, "generation"), key=lambda s: s["start_ns"])
    meta = "langfuse.observation.metadata."
    got = [
        (g["attributes"].get(meta + "adapter"), g["attributes"].get(meta + "policy_version"))
        for g in generations
    ]
    assert got == [('"rep/team.planner"', "0"), ('"rep/team.executor"', "0")]
