"""Our three ART-style training scripts (examples/art_ports/) run as a user runs them, on the tiny model: each trains
two steps through its own LocalBackend and vLLM server, and at least one of its steps trains sampled tokens."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from art_adapters.testing import Reply, ScriptedServer
from art_adapters.tiny import tiny_model_path
from fixtures_s3 import BUCKET
from test_deployment import KEY as TOGETHER_KEY
from test_deployment import TogetherStandIn
from test_remote_backend import running

pytestmark = [pytest.mark.vllm, pytest.mark.train]
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "art_ports"


def run_script(name: str, path: Path, *args: str) -> str:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / name),
            "--base-model",
            str(tiny_model_path()),
            "--path",
            str(path),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def trained_tokens(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"trained_tokens (\d+)", stdout)]


def test_number_game_trains_with_model_train(tmp_path: Path) -> None:
    out = run_script("number_game.py", tmp_path, "--steps", "2", "--groups", "2", "--group-size", "4")
    assert len(trained_tokens(out)) == 2 and max(trained_tokens(out)) > 0, out
    folder = tmp_path / "number-game" / "models" / "number-game-001"
    assert (folder / "checkpoints" / "0002").is_dir()
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [0, 1]  # model.train logs, as in ART 0.5.17


def test_tool_agent_with_ruler_trains_with_backend_train(tmp_path: Path) -> None:
    out = run_script("tool_agent_ruler.py", tmp_path, "--steps", "2", "--group-size", "3")
    assert len(trained_tokens(out)) == 2 and max(trained_tokens(out)) > 0, out
    folder = tmp_path / "support" / "models" / "support-001"
    assert (folder / "checkpoints" / "0002").is_dir()
    logged = [
        json.loads(line)
        for line in (folder / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()
    ]
    assert logged and all(
        "ruler_score" in t["metrics"] and "independent_reward" in t["metrics"] for t in logged
    )
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("train/loss" in r for r in rows)  # from model.log only


def test_langgraph_agent_trains_with_init_chat_model(tmp_path: Path) -> None:
    out = run_script("langgraph_agent.py", tmp_path, "--steps", "2", "--group-size", "3")
    assert len(trained_tokens(out)) == 2 and max(trained_tokens(out)) > 0, out
    assert all(
        int(n) >= 12 for n in re.findall(r"llm calls (\d+)", out)
    )  # every rollout's calls were captured
    folder = tmp_path / "langgraph" / "models" / "capitals-001"
    assert (folder / "checkpoints" / "0002").is_dir()


def test_arts_pipeline_example_trains_with_its_pipeline_trainer(tmp_path: Path) -> None:
    """ART's yes/no/maybe pipeline example, its backend swapped for ours: rollouts overlap the steps, ART's pipeline
    metrics land in history.jsonl (the example reads `train/reward_std_dev` back), eval runs every 2 steps beside
    training (ART main: since the last evaluated step, step 0 at first)."""
    out = run_script(
        "yes_no_maybe_pipeline.py",
        tmp_path,
        *("--steps", "3", "--rollouts-per-scenario", "8", "--groups-per-step", "2", "--workers", "3"),
        *("--eval-scenarios", "4", "--learning-rate", "1e-3", "--warm-start", "4"),
    )
    assert len(trained_tokens(out)) == 3 and min(trained_tokens(out)) > 0, out
    folder = tmp_path / "yes-no-maybe-pipeline" / "models" / "pipeline-yes-no-maybe"
    assert (folder / "checkpoints" / "0004").is_dir()  # the warm start, then three pipeline steps
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [2, 3, 4]
    assert all(
        0 <= r["train/steps_off_policy"] <= 1 and r["train/discarded_stale_groups"] >= 0 for r in train
    )
    assert [r["step"] for r in rows if r.get("split") == "val"] == [2, 4]  # ART: every 2 steps since step 0
    state = json.loads((folder / "state.json").read_text())
    assert state["_pipeline_trainer"]["training_step"] == 4


# ---- ART's 2048, tic-tac-toe and LangGraph email examples: S3 backups, RULER with o4-mini, Together ---------------


def local_judge(request: dict[str, Any]) -> Reply:
    """Stands in for OpenAI's judges: refuses a temperature as o-series models do, answers RULER's request with one
    score per trajectory (1.0, 0.5, 0.0, ...), and a correctness question with an accepting verdict."""
    if request.get("temperature") not in (None, 1, 1.0):
        message = "Unsupported value: 'temperature' does not support 0.0 with this model."
        return Reply(
            status=400, raw_body=json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
        )
    prompt = str(request["messages"][-1]["content"])
    if "Reference answer" in prompt:
        return Reply(content=json.dumps({"reasoning": "matches", "accept": True}))
    count = prompt.count("<trajectory id=")
    scores = [
        {"trajectory_id": str(i), "explanation": "ok", "score": 1 - (i - 1) / max(count, 1)}
        for i in range(1, count + 1)
    ]
    return Reply(content=json.dumps({"scores": scores}))


@pytest.fixture
def judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedServer]:
    with ScriptedServer(local_judge) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-local-judge")
        yield server


def bucket_steps(s3: Any, project: str, name: str) -> list[str]:
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{project}/models/{name}/checkpoints/").get(
        "Contents", []
    )
    return sorted({o["Key"].split("/")[4] for o in listing if o["Key"].endswith("adapter_model.safetensors")})


def test_arts_2048_example_judges_with_o4_mini_and_backs_up_to_s3(
    s3_server: Any, judge: ScriptedServer, tmp_path: Path
) -> None:
    out = run_script("game_2048.py", tmp_path, "--steps", "1", "--games", "4")
    assert "training from step 0" in out and trained_tokens(out) and trained_tokens(out)[0] > 0, out
    assert "judged 4" in out, out  # RULER scored the whole group
    assert judge.requests and all(r["model"] == "o4-mini" and "temperature" not in r for r in judge.requests)
    assert bucket_steps(s3_server, "2048", "tutorial-001") == ["0000"]  # pushed before the step, as ART does


def test_arts_tic_tac_toe_example_resumes_from_the_bucket_and_deploys(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run_script("tic_tac_toe.py", tmp_path / "a", "--steps", "1", "--games", "4", "--pull-from-s3")
    assert "training from step 0" in first and trained_tokens(first), first
    assert bucket_steps(s3_server, "tic-tac-toe", "tic-tac-toe-001")[-1] == "0001"

    together = TogetherStandIn(queued_polls=0)
    with running(together.app()) as url:
        monkeypatch.setenv("TOGETHER_BASE_URL", url)
        monkeypatch.setenv("TOGETHER_API_KEY", TOGETHER_KEY)
        second = run_script(  # a fresh machine: only the bucket knows the run
            "tic_tac_toe.py", tmp_path / "b", "--steps", "2", "--games", "4", "--pull-from-s3", "--deploy"
        )
    assert "training from step 1" in second and "step 2:" in second, second
    assert bucket_steps(s3_server, "tic-tac-toe", "tic-tac-toe-001")[-1] == "0002"
    tag = hashlib.sha256(b"tic-tac-toe\0tic-tac-toe-001").hexdigest()[:8]  # deployment.deployed_name's
    name = f"tic-tac-toe-tic-tac-toe-001-2-{tag}"
    assert [u["model_name"] for u in together.uploads] == [name]
    assert together.chats and together.chats[0]["model"] == f"acct/{name}", second
    assert f"deployed acct/{name}" in second


def test_arts_langgraph_email_example_trains_with_ruler_and_a_litellm_judge(
    judge: ScriptedServer, tmp_path: Path
) -> None:
    out = run_script("langgraph_email.py", tmp_path, "--steps", "1", "--rollouts-per-group", "3")
    assert len(trained_tokens(out)) == 1 and trained_tokens(out)[0] > 0, out
    assert all(int(n) >= 6 for n in re.findall(r"llm calls (\d+)", out)), out
    ruler_requests = [r for r in judge.requests if "<trajectory id=" in str(r["messages"][-1]["content"])]
    assert len(ruler_requests) == 2 and all("temperature" not in r for r in ruler_requests)
