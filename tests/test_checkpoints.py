"""ART's checkpoint layout: atomic saves, crash leftovers, latest/list/delete, history and trajectory files."""

from __future__ import annotations

import os

import pytest

from art_adapters import checkpoints as ck
from art_adapters.trajectories import Trajectory, read_jsonl


def write_files(n: int):
    def write(directory):
        for i in range(n):
            (directory / f"f{i}.bin").write_bytes(os.urandom(64))

    return write


def test_layout_and_steps(tmp_path) -> None:
    model = ck.model_dir("proj", "agent", art_path=tmp_path / ".art")
    assert model == tmp_path / ".art" / "proj" / "models" / "agent"
    assert ck.latest_step(model) == 0 and ck.list_steps(model) == []
    for step in (3, 1, 12):
        path = ck.save_checkpoint(model, step, write_files(2))
        assert path == model / "checkpoints" / f"{step:04d}" and sorted(p.name for p in path.iterdir()) == [
            "f0.bin",
            "f1.bin",
        ]
    assert ck.list_steps(model) == [1, 3, 12] and ck.latest_step(model) == 12
    with pytest.raises(FileExistsError):
        ck.save_checkpoint(model, 3, write_files(1))
    ck.save_checkpoint(model, 3, write_files(1), overwrite=True)
    assert [p.name for p in ck.checkpoint_dir(model, 3).iterdir()] == ["f0.bin"]
    assert not [p for p in (model / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_crashed_save_leaves_nothing_visible_and_is_cleaned(tmp_path) -> None:
    model = tmp_path / "m"
    ck.save_checkpoint(model, 1, write_files(1))

    def crash(directory):
        (directory / "adapter_model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(model, 2, crash)
    assert ck.list_steps(model) == [1] and ck.latest_step(model) == 1
    # A hard kill (no cleanup ran) leaves a hidden temp dir: invisible to list_steps, removed on start.
    leftover = model / "checkpoints" / ".tmp-0002-abc"
    leftover.mkdir()
    (leftover / "adapter_config.json").write_text("{")
    assert ck.list_steps(model) == [1]
    assert ck.clean_temp_dirs(model) == [leftover] and not leftover.exists()


def test_delete_checkpoints_keeps_the_given_steps(tmp_path) -> None:
    model = tmp_path / "m"
    for step in range(1, 6):
        ck.save_checkpoint(model, step, write_files(1))
    assert ck.delete_checkpoints(model, keep={2, 5}) == [1, 3, 4]
    assert ck.list_steps(model) == [2, 5]
    assert not [p for p in (model / "checkpoints").iterdir() if p.name.startswith(".")]


def test_history_and_trajectories(tmp_path) -> None:
    model = tmp_path / "m"
    ck.append_history(model, {"step": 1, "reward_mean": 0.5})
    ck.append_history(model, {"step": 2, "reward_mean": 0.75, "note": "ok"})
    assert ck.read_history(model) == [
        {"step": 1, "reward_mean": 0.5},
        {"step": 2, "reward_mean": 0.75, "note": "ok"},
    ]
    path = ck.write_trajectories(model, "train", 7, [Trajectory(reward=1.0), Trajectory(reward=0.0)])
    assert path == model / "trajectories" / "train" / "0007.jsonl"
    assert [t.reward for t in read_jsonl(path)] == [1.0, 0.0]
