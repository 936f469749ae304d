"""ART's S3 checkpoint sync against a real S3 server (moto's, started here): ART's layout both ways, only what
changed moves, a partial upload is never a checkpoint, and a missing bucket or credentials is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.backend.s3 import S3SyncError
from fixtures_s3 import BUCKET


def model_folder(root: Path, steps: int = 2) -> tuple[art.LocalBackend, art.TrainableModel, Path]:
    backend = art.LocalBackend(root)
    model = art.TrainableModel(name="agent-001", project="2048", base_model="tiny")
    folder = backend.model_dir(model)
    for step in range(steps + 1):
        checkpoint = folder / "checkpoints" / f"{step:04d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "adapter_config.json").write_text(json.dumps({"r": 8, "step": step}))
        (checkpoint / "adapter_model.safetensors").write_bytes(bytes([step]) * 1000)
        (checkpoint / "optimizer.pt").write_bytes(b"o" * 100)
    (folder / "history.jsonl").write_text('{"step": 1}\n')
    (folder / "trajectories" / "train").mkdir(parents=True)
    (folder / "trajectories" / "train" / "0001.jsonl").write_text("{}\n")
    (folder / "checkpoints" / ".tmp-0003-abc").mkdir()  # a step still being written: never pushed
    (folder / "checkpoints" / ".tmp-0003-abc" / "adapter_config.json").write_text("{}")
    return backend, model, folder


def keys(s3: object) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []))  # type: ignore[attr-defined]


async def test_push_then_pull_in_arts_layout_moves_only_what_changed(
    s3_server: object, tmp_path: Path
) -> None:
    backend, model, folder = model_folder(tmp_path / "a")
    await backend._experimental_push_to_s3(model)
    uploaded = keys(s3_server)
    assert "2048/models/agent-001/checkpoints/0002/adapter_model.safetensors" in uploaded
    assert "2048/models/agent-001/history.jsonl" in uploaded and not any(".tmp" in k for k in uploaded)
    assert len(uploaded) == 3 * 3 + 2

    elsewhere = art.LocalBackend(tmp_path / "b")
    await elsewhere._experimental_pull_from_s3(model)
    pulled = elsewhere.model_dir(model)
    for path in folder.rglob("*"):
        if path.is_file() and ".tmp" not in str(path):
            assert (pulled / path.relative_to(folder)).read_bytes() == path.read_bytes()

    from art_adapters.backend import s3

    location = s3.S3Location.of("2048", "agent-001")
    assert await_sync(s3.push, folder, location) == []  # nothing changed: nothing sent
    (folder / "history.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert await_sync(s3.push, folder, location) == ["history.jsonl"]
    assert await_sync(s3.pull, pulled, location) == ["history.jsonl"]


def await_sync(fn: object, *args: object, **kwargs: object) -> list[str]:
    return fn(*args, **kwargs)  # type: ignore[operator]


async def test_a_bucket_ART_wrote_restores_and_a_partial_checkpoint_is_never_taken(
    s3_server: object, tmp_path: Path
) -> None:
    """Objects as ART's `aws s3 sync` leaves them (its parquet trajectories too), plus a checkpoint whose upload
    stopped before its adapter config: the pull restores the complete ones and skips the partial one."""
    prefix = "runs/2048/models/agent-001/"
    for step in (1, 2):
        s3_server.put_object(
            Bucket=BUCKET, Key=f"{prefix}checkpoints/{step:04d}/adapter_config.json", Body=b"{}"
        )  # type: ignore[attr-defined]
        s3_server.put_object(
            Bucket=BUCKET, Key=f"{prefix}checkpoints/{step:04d}/adapter_model.safetensors", Body=b"w" * 64
        )  # type: ignore[attr-defined]
    s3_server.put_object(
        Bucket=BUCKET, Key=f"{prefix}checkpoints/0003/adapter_model.safetensors", Body=b"half"
    )  # type: ignore[attr-defined]
    s3_server.put_object(Bucket=BUCKET, Key=f"{prefix}trajectories/train/0002.parquet", Body=b"PAR1")  # type: ignore[attr-defined]
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(name="agent-001", project="2048", base_model="tiny")
    await backend._experimental_pull_from_s3(model, prefix="runs")
    folder = backend.model_dir(model)
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["0001", "0002"]
    assert (folder / "trajectories" / "train" / "0002.parquet").read_bytes() == b"PAR1"
    latest = await backend._experimental_pull_model_checkpoint(
        model, step="latest", s3_bucket=BUCKET, prefix="runs"
    )
    assert latest.endswith("checkpoints/0002")
    s3_server.put_object(Bucket=BUCKET, Key=f"{prefix}checkpoints/0003/adapter_config.json", Body=b"{}")  # type: ignore[attr-defined]
    copied = await backend._experimental_pull_model_checkpoint(
        model, step="latest", s3_bucket=BUCKET, prefix="runs", local_path=str(tmp_path / "export")
    )
    assert (
        copied == str(tmp_path / "export")
        and (tmp_path / "export" / "adapter_model.safetensors").read_bytes() == b"half"
    )

    fork = art.TrainableModel(name="agent-002", project="2048", base_model="tiny")
    await backend._experimental_fork_checkpoint(
        fork, "agent-001", from_s3_bucket=BUCKET, prefix="runs", not_after_step=2
    )
    assert sorted(p.name for p in (backend.model_dir(fork) / "checkpoints").iterdir()) == ["0002"]


async def test_a_missing_bucket_or_credentials_is_one_clear_error(
    s3_server: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, model, _ = model_folder(tmp_path)
    with pytest.raises(S3SyncError, match="bucket 'nowhere' does not exist"):
        await backend._experimental_push_to_s3(model, s3_bucket="nowhere")
    monkeypatch.delenv("BACKUP_BUCKET")
    with pytest.raises(S3SyncError, match="set BACKUP_BUCKET"):
        await backend._experimental_pull_from_s3(model)
    monkeypatch.setenv("BACKUP_BUCKET", BUCKET)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(S3SyncError, match="credentials missing or refused"):
        await backend._experimental_push_to_s3(model)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    ghost = art.TrainableModel(name="ghost", project="2048", base_model="t")
    await backend._experimental_pull_from_s3(ghost)  # a first run: nothing saved yet, nothing to do
    assert not backend.model_dir(ghost).exists()
    with pytest.raises(S3SyncError, match="no complete checkpoint 0003"):
        await backend._experimental_pull_from_s3(ghost, only_step=3)


async def test_arts_backendless_s3_helpers(s3_server: object, tmp_path: Path) -> None:
    """`art.utils.s3` / `s3_checkpoint_utils`: by project and name, with an `art_path`, no backend."""
    import httpx

    from art_adapters.utils.s3 import (
        archive_and_presign_step_url,
        build_s3_path,
        ensure_bucket_exists,
        pull_model_from_s3,
        push_model_to_s3,
    )
    from art_adapters.utils.s3_checkpoint_utils import (
        get_checkpoint_step_not_after_from_s3,
        get_latest_checkpoint_step_from_s3,
    )

    _, _, folder = model_folder(tmp_path / "a")
    assert build_s3_path(model_name="agent-001", project="2048", step=2, prefix="/runs/") == (
        f"s3://{BUCKET}/runs/2048/models/agent-001/checkpoints/0002"
    )
    assert await get_latest_checkpoint_step_from_s3("agent-001", "2048") is None
    await push_model_to_s3("agent-001", "2048", art_path=str(tmp_path / "a"))
    assert await get_latest_checkpoint_step_from_s3("agent-001", "2048") == 2
    assert await get_checkpoint_step_not_after_from_s3("agent-001", "2048", 1) == 1
    pulled = await pull_model_from_s3("agent-001", "2048", step=1, art_path=str(tmp_path / "b"))
    assert sorted(p.name for p in (Path(pulled) / "checkpoints").iterdir()) == ["0001"]
    assert (Path(pulled) / "checkpoints" / "0001" / "adapter_model.safetensors").read_bytes() == bytes(
        [1]
    ) * 1000

    url = await archive_and_presign_step_url("agent-001", "2048", 2, art_path=str(tmp_path / "a"))
    async with httpx.AsyncClient() as client:
        archive = await client.get(url)
    assert archive.status_code == 200 and archive.content[:2] == b"PK"

    await ensure_bucket_exists("fresh-bucket")  # created when missing, left alone when there
    await ensure_bucket_exists("fresh-bucket")
    assert "fresh-bucket" in [b["Name"] for b in s3_server.list_buckets()["Buckets"]]  # type: ignore[attr-defined]
    with pytest.raises(S3SyncError, match="no local model folder"):
        await push_model_to_s3("nobody", "2048", art_path=str(tmp_path / "a"))
    assert folder.is_dir()
