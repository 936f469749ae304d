"""The report's per-agent view of a run folder that is not at `{project}/models/{name}` (a copied run, `art-adapters
report ./my-run`): the calls of another model served by the same gateway (`q/llama3.1@2`, a partner or judge model)
are not read as an agent's adapter ("1") of this model, whose own `model.json` says who it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.calls import LLMCall
from art_adapters.report import write_report


def run_folder(root: Path) -> Path:
    folder = root / "rep" / "models" / "team"
    model = art.TrainableModel(name="team", project="rep", base_model="tiny")
    folder.mkdir(parents=True)
    (folder / "model.json").write_text(model.model_dump_json())
    calls = [
        LLMCall(request={"model": "rep/team"}, served_model="rep/team@0", policy_version=0),
        LLMCall(request={"model": "q/llama3.1"}, served_model="q/llama3.1@2", policy_version=2),
    ]
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    trajectory.llm_calls = calls
    checkpoints.write_trajectories(folder, "train", 0, [trajectory])
    checkpoints.append_history(folder, {"step": 0, "loss": 0.5})
    return folder


def test_a_copied_run_folder_shows_no_agent_for_another_models_calls(tmp_path: Path) -> None:
    folder = run_folder(tmp_path)
    assert 'id="agents"' not in write_report(folder).read_text()  # in place: the folder names the model
    copied = tmp_path / "my-run"
    shutil.copytree(folder, copied)
    page = write_report(copied).read_text()
    assert 'id="agents"' not in page, "another model's calls read as this model's agent '1'"
