"""The local HTML report: built from a fake model dir of captured trajectories, rendered in headless Chromium."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest

from art_adapters import role
from art_adapters.capture import RecordingTransport, capture
from art_adapters.report import call_tokens, read_history, report_command, write_report
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import Trajectory, write_jsonl

STEPS = 6
CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
)
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def captured_rollout(server_url: str, city: str, reward: float) -> Trajectory:
    """A real tool-using rollout through the recording client (token ids and logprobs requested)."""
    http = httpx.Client(transport=RecordingTransport(request_token_ids=True))
    client = openai.OpenAI(base_url=server_url, api_key="x", max_retries=0, http_client=http)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages: list[dict] = [{"role": "user", "content": f"What is the capital of {city}?"}]
    with capture() as trajectory:
        with role("searcher"):
            first = client.chat.completions.create(model="agent", messages=messages, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": f"{city} City"},
        ]
        with role("answerer"):
            client.chat.completions.create(model="agent", messages=messages, tools=tools)
    trajectory.reward = reward
    trajectory.metrics = {"correct": reward > 0.5}
    return trajectory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("art") / "proj" / "models" / "agent-001"
    script = [
        Reply(tool_calls=[{"name": "lookup", "arguments": {"q": "capital"}}]),
        Reply(content="It is Zanzibar City."),
    ]
    with ScriptedServer(script, cycle=True) as server:
        for step in range(STEPS):
            rollouts = [
                captured_rollout(server.base_url, "Zanzibar", reward=(step + i) / (STEPS + 2))
                for i in range(2)
            ]
            write_jsonl(root / "trajectories" / "train" / f"{step:04d}.jsonl", rollouts)
        write_jsonl(
            root / "trajectories" / "val" / "0005.jsonl", [captured_rollout(server.base_url, "Mars", 1.0)]
        )
    rows = [
        {
            "step": s,
            "reward_mean": s / STEPS,
            "reward_std": 0.1,
            "loss": 1 / (s + 1),
            "kl": 0.01 * s,
            "grad_norm": 0.3,
        }
        | {"trained_tokens": 100 + s, "exception_rate": 0.0, "note": "ignored"}
        for s in range(STEPS)
    ]
    (root / "history.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return root


def test_history_is_read_tolerantly(model_dir):
    history = read_history(model_dir / "history.jsonl")
    assert [r["step"] for r in history] == list(range(STEPS))
    assert "note" not in history[0] and history[2]["loss"] == pytest.approx(1 / 3)


def test_token_pieces_come_from_response_logprobs(model_dir):
    trajectory = Trajectory.model_validate_json(
        (model_dir / "trajectories/train/0000.jsonl").read_text().splitlines()[0]
    )
    call = trajectory.llm_calls[1]
    assert call.completion_token_ids and call.logprobs
    tokens = call_tokens(call)
    assert len(tokens) == len(call.completion_token_ids)
    assert "".join(t[0] for t in tokens).startswith("It is Zanzibar")
    assert all(t[1] is not None and t[1] <= 0 and not math.isnan(t[1]) for t in tokens)


def test_report_files(model_dir, tmp_path, capsys):
    out = write_report(model_dir, tmp_path / "r")
    assert out == tmp_path / "r" / "report.html"
    page = out.read_text()
    assert "<script src" not in page and "http://" not in page and "https://" not in page
    for name in ("reward.png", "loss.png", "kl.png"):
        assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report_command(str(model_dir), None)
    assert "report:" in capsys.readouterr().out and (model_dir / "report.html").exists()


class _Rendered(HTMLParser):
    """Counts chart points per chart and collects the text rendered into #viewer and #trajectory-list."""

    def __init__(self) -> None:
        super().__init__()
        self.points: dict[str, int] = {}
        self.chart: str | None = None
        self.stack: list[str] = []
        self.viewer_text: list[str] = []
        self.buttons = 0
        self.rendered = False
        self.shaded = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "chart":
            self.chart = a.get("data-metric")
            self.points[self.chart or ""] = 0
        if tag == "circle" and a.get("class") == "point" and self.chart is not None:
            self.points[self.chart] += 1
        if a.get("id") == "viewer":
            self.rendered = a.get("data-rendered") == "1"
        if tag == "span" and a.get("class") == "tok" and "background" in (a.get("style") or ""):
            self.shaded += 1
        if tag == "button" and "trajectory-list" in self.stack:
            self.buttons += 1
        self.stack.append(a.get("id") or tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.chart = None
        if self.stack:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if "viewer" in self.stack:
            self.viewer_text.append(data)


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (CI installs it: apt-get install -y chromium)"
)
def test_report_renders_in_headless_chromium(model_dir, tmp_path):
    out = write_report(model_dir, tmp_path / "report.html")
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Rendered()
    parsed.feed(dom.stdout)
    assert (
        parsed.points["reward"] == STEPS and parsed.points["loss"] == STEPS and parsed.points["KL"] == STEPS
    )
    assert parsed.points["grad_norm"] == STEPS
    assert parsed.rendered, "the trajectory browser script did not run"
    text = "".join(parsed.viewer_text)
    assert "What is the capital of Zanzibar?" in text and "lookup" in text and "Zanzibar City" in text
    assert "role searcher · 1 call(s)" in text and "role answerer · 1 call(s)" in text  # calls grouped
    assert parsed.buttons == 2  # two trajectories at the last train step
    assert parsed.shaded > 5  # sampled tokens shaded by logprob
    shot = tmp_path / "report.png"
    result = chromium("--hide-scrollbars", "--window-size=1280,1500", f"--screenshot={shot}", out.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_where_labels_name_node_agent_and_role() -> None:
    from art_adapters.report import where_label
    from art_adapters.sources import CallSource

    assert where_label(CallSource(node="critic", checkpoint_ns="review:1")) == "node review/critic"
    agent = CallSource(agent="billing", agent_path=["billing"], handoffs=["triage"], role="biller")
    assert where_label(agent) == "agent billing (after triage) · role biller"
    assert (
        where_label(CallSource(agent="expert", agent_path=["billing", "expert"])) == "agent billing > expert"
    )
    assert where_label(CallSource()) == ""


def test_each_call_shows_the_version_that_sampled_it() -> None:
    """Issue 22: the version travels to the report's call view and to each Langfuse generation."""
    from art_adapters.report import trajectory_view
    from art_adapters.tracing._convert import generation_obs
    from art_adapters.trajectories import LLMCall

    call = LLMCall(
        request={"model": "proj/agent", "messages": [{"role": "user", "content": "hi"}]},
        response={
            "model": "proj/agent",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}}],
        },
        model="proj/agent",
        policy_version=3,
        served_model="proj/agent@3",
    )
    view = trajectory_view(Trajectory(llm_calls=[call], reward=1.0))
    assert view["calls"][0]["version"] == 3
    obs = generation_obs(call, 0, step=5)  # the rollout ran at step 5; version 3 sampled this call
    assert obs.model == "proj/agent@3"
    assert obs.metadata["policy_version"] == 3 and obs.metadata["served_model"] == "proj/agent@3"
    unversioned = generation_obs(
        call.model_copy(update={"policy_version": None, "served_model": None}), 0, step=5
    )
    assert unversioned.model == "proj/agent@5" and "policy_version" not in unversioned.metadata
