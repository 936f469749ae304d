"""A shared or forked bucket from an attacker's side (a real S3 server, moto's): object keys that climb out of the
model's folder, absolute tails, step numbers in other scripts' digits, names too long for a file system, and names
the folder's own layout needs otherwise (a file `checkpoints`, a name both a file and a folder). Nothing lands
outside the folder, the good files still arrive, and one bad key breaks no pull."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.backend import s3
from fixtures_s3 import BUCKET

PREFIX = "runs/2048/models/agent-001/"


def put(client: object, key: str, body: bytes = b"x") -> None:
    client.put_object(Bucket=BUCKET, Key=key, Body=body)  # type: ignore[attr-defined]


def a_checkpoint(client: object, step: str) -> None:
    put(client, f"{PREFIX}checkpoints/{step}/adapter_model.safetensors", b"w" * 64)
    put(client, f"{PREFIX}checkpoints/{step}/adapter_config.json", json.dumps({"r": 8}).encode())


def planted_anywhere() -> bool:
    return Path("/tmp/pwned").exists() or Path("/escape").exists()


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


async def test_keys_that_climb_out_of_the_model_folder_write_nothing_there(
    s3_server: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`../../x`, an absolute tail (`prefix//abs/...`: a `.pth` there runs at the next Python start) and
    `checkpoints/0001/../../../../x` each wrote a file above the model folder."""
    home = tmp_path / "home"
    escape = home / "escape"
    climbing = [
        f"{PREFIX}../../../../escape/climbed.pth",
        f"{PREFIX}/{escape.as_posix().lstrip('/')}/absolute.pth",
        f"{PREFIX}checkpoints/0001/../../../../../escape/nested.pth",
        f"{PREFIX}checkpoints/0001/./adapter_model.safetensors",
        f"{PREFIX}trajectories//train.jsonl",
    ]
    for key in climbing:
        put(s3_server, key, b"import os; os.system('id > /tmp/pwned')")
    a_checkpoint(s3_server, "0001")
    put(s3_server, f"{PREFIX}history.jsonl", b'{"step": 1}\n')
    backend = art.LocalBackend(home / "art")
    model = art.TrainableModel(name="agent-001", project="2048", base_model="tiny")
    with caplog.at_level(logging.WARNING, logger="art_adapters.backend.s3"):
        await backend._experimental_pull_from_s3(model, prefix="runs")
        await backend._experimental_pull_from_s3(model, prefix="runs", only_step=1)
    folder = backend.model_dir(model)
    assert files_under(home) == {
        f"{folder.relative_to(home).as_posix()}/{name}"
        for name in (
            "history.jsonl",
            "checkpoints/0001/adapter_config.json",
            "checkpoints/0001/adapter_model.safetensors",
        )
    }
    assert not planted_anywhere()
    assert (folder / "checkpoints/0001/adapter_model.safetensors").read_bytes() == b"w" * 64
    refused = " ".join(r.getMessage() for r in caplog.records)
    assert "climbed.pth" in refused and "absolute.pth" in refused and "nested.pth" in refused


def test_a_destination_outside_the_folder_is_refused_even_through_a_link(tmp_path: Path) -> None:
    """The resolved destination is checked too: a link inside the folder does not carry a write outside it."""
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "trajectories").symlink_to(outside)
    assert s3.local_destination(folder, "history.jsonl") == folder.resolve() / "history.jsonl"
    for key in ("trajectories/train/0001.jsonl", "../x", "a//b", "/etc/passwd", "a/./b", "a\\..\\b"):
        with pytest.raises(s3.S3SyncError, match="outside|refused"):
            s3.local_destination(folder, key)


async def test_step_numbers_in_other_digits_are_not_steps_and_break_no_pull(
    s3_server: object, tmp_path: Path
) -> None:
    """`"²".isdigit()` is True and `int("²")` raises: one such key made every pull of the prefix fail."""
    a_checkpoint(s3_server, "0002")
    a_checkpoint(s3_server, "²")
    a_checkpoint(s3_server, "٣")  # Arabic-Indic three: int() reads it as 3
    location = s3.S3Location.of("2048", "agent-001", BUCKET, "runs")
    assert s3.remote_steps(s3.remote_files(s3.client(), location)) == [2]
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(name="agent-001", project="2048", base_model="tiny")
    await backend._experimental_pull_from_s3(model, prefix="runs")
    checkpoints = backend.model_dir(model) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0002"]
    (checkpoints / "³").mkdir()  # a stray local folder is not a step either
    assert art.checkpoints.list_steps(backend.model_dir(model)) == [2]


def a_model_in_the_bucket(client: object) -> None:
    a_checkpoint(client, "0001")
    put(client, f"{PREFIX}history.jsonl", b'{"step": 1}\n')
    put(client, f"{PREFIX}trajectories/train/0001.jsonl", b"{}\n")


GOOD = {
    "history.jsonl",
    "trajectories/train/0001.jsonl",
    "checkpoints/0001/adapter_config.json",
    "checkpoints/0001/adapter_model.safetensors",
}


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("trajectories/" + "a" * 300 + ".jsonl", "a name of 306 bytes"),  # ENAMETOOLONG
        ("logs/" + "é" * 128, "a name of 256 bytes"),  # 128 characters, but 256 bytes on disk
        ("checkpoints", "a file where the model folder's checkpoints/ folder must be"),  # later saves failed
        ("logs", "a file where the model folder's logs/ folder must be"),
        ("checkpoints/0002", "a file where checkpoint 0002's folder must be"),
        ("history.jsonl/x", "a path through history.jsonl"),
        (
            "checkpoints/0001/adapter_model.safetensors/x",
            "its path runs through",
        ),  # a file and a folder of one name
        ("trajectories/train/0001.jsonl/deeper/x", "its path runs through"),
    ],
)
async def test_one_bad_key_breaks_no_pull(
    s3_server: object, tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, why: str
) -> None:
    """Keys that stay inside the folder yet cannot be its files: each failed the whole pull with a raw OSError
    (a run that pulls at start could not resume), and a file `checkpoints` written first stayed, so every later
    checkpoint save failed. Now each is refused with a warning saying why, and everything else arrives."""
    a_model_in_the_bucket(s3_server)
    put(s3_server, PREFIX + key)
    backend = art.LocalBackend(tmp_path / "art")
    model = art.TrainableModel(name="agent-001", project="2048", base_model="tiny")
    with caplog.at_level(logging.WARNING, logger="art_adapters.backend.s3"):
        await backend._experimental_pull_from_s3(model, prefix="runs")
    folder = backend.model_dir(model)
    assert files_under(folder) == GOOD  # nothing of the bad key, no partial file
    assert (folder / "checkpoints/0001/adapter_model.safetensors").read_bytes() == b"w" * 64
    assert art.checkpoints.list_steps(folder) == [1]
    assert all((folder / name).is_dir() for name in ("checkpoints", "trajectories"))
    ours = [r.getMessage() for r in caplog.records if r.name == "art_adapters.backend.s3"]
    assert len(ours) == 1 and f"{PREFIX}{key}' refused: {why}" in ours[0], ours


def test_a_local_place_that_cannot_take_a_file_skips_that_file_alone(
    s3_server: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A local folder where the bucket has a file (or a file where it has a folder) failed the pull at that file,
    after the files before it had landed, and left its `.part` behind. Now that file or checkpoint is skipped
    with a warning, nothing local is overwritten, and the rest arrives."""
    a_model_in_the_bucket(s3_server)
    put(s3_server, f"{PREFIX}notes.txt", b"remote notes")
    put(s3_server, f"{PREFIX}logs/run.log", b"remote log")
    a_checkpoint(s3_server, "0002")
    folder = tmp_path / "agent-001"
    (folder / "notes.txt").mkdir(parents=True)  # a folder where the bucket has a file
    (folder / "notes.txt/mine").write_text("local")
    (folder / "logs").write_text("a local file where the bucket has a folder")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints/0002").write_text("a local file where the bucket has a checkpoint")
    with caplog.at_level(logging.WARNING, logger="art_adapters.backend.s3"):
        received = s3.pull(folder, s3.S3Location.of("2048", "agent-001", BUCKET, "runs"))
    assert files_under(folder) == GOOD | {"notes.txt/mine", "logs", "checkpoints/0002"}  # no partial file
    assert (folder / "notes.txt/mine").read_text() == "local"
    assert (folder / "logs").read_text().startswith("a local file")
    assert (folder / "checkpoints/0002").read_text().startswith("a local file")
    assert not any(p.name.startswith(".") for p in folder.rglob("*"))  # no staging folder or `.part` left
    skipped = " ".join(r.getMessage() for r in caplog.records if r.name == "art_adapters.backend.s3")
    for name in ("notes.txt", "logs/run.log", "checkpoints/0002"):
        assert f"{PREFIX}{name}' skipped: its local place cannot take it" in skipped, skipped
    assert sorted(received) == sorted(GOOD)  # what was skipped is not reported received
