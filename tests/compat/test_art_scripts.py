"""Our three ART-style training scripts (examples/art_ports/) run as a user runs them, on the tiny model: each trains
two steps through its own LocalBackend and vLLM server, and at least one of its steps trains sampled tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from art_adapters.tiny import tiny_model_path

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
    metrics land in history.jsonl (the example reads `train/reward_std_dev` back), eval runs every 2 steps."""
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
    assert [r["step"] for r in rows if r.get("split") == "val"] == [3]
    state = json.loads((folder / "state.json").read_text())
    assert state["_pipeline_trainer"]["training_step"] == 4
