"""WandbLogger in WANDB_MODE=offline, read back from the run's transaction log; weave-decorated rollouts still capture."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup


def read_history(run_file: Path) -> list[dict[str, Any]]:
    """History rows of an offline run's .wandb file (a LevelDB-style log of `Record` protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows: list[dict[str, Any]] = []
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def sample_groups() -> list[TrajectoryGroup]:
    def one(reward: float) -> Trajectory:
        return Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": f"{reward}"},
            ],
            llm_calls=[LLMCall(request={"model": "m", "messages": []}, completion_token_ids=[1, 2, 3])],
            reward=reward,
            metrics={"correct": reward > 0.5},
        )

    return [
        TrajectoryGroup([one(1.0), one(0.0)]),
        TrajectoryGroup([one(0.5)], exceptions=[{"type": "E", "message": "x"}]),
    ]


def test_import_does_not_load_wandb():
    code = "import sys, art_adapters.tracing.wandb; assert 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_offline_run_has_step_metrics_and_trajectory_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from art_adapters.tracing.wandb import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger("art-test", name="run-1", config={"learning_rate": 1e-5})
    history = [
        {
            "step": s,
            "reward_mean": 0.2 * s,
            "reward_std": 0.1,
            "loss": 1.0 / (s + 1),
            "grad_norm": 0.5,
            "kl": 0.01 * s,
        }
        | {"trained_tokens": 100 * s, "exception_rate": 0.0, "note": "text is skipped"}
        for s in range(3)
    ]
    for row in history:
        logged = logger.log_step(row["step"], row)
        assert "train/note" not in logged and "train/step" not in logged
    metrics = logger.log_groups(2, sample_groups(), split="val")
    assert metrics["reward_mean"] == pytest.approx(0.5) and metrics["exception_rate"] == pytest.approx(0.25)
    assert logger.log_trajectories(2, sample_groups(), max_rows=2) == 2
    run_dir = Path(logger.run.dir).parent
    logger.finish()

    run_file = next(run_dir.glob("*.wandb"))
    deadline = time.monotonic() + 15  # wandb-core may still be writing the log's last block
    while len(rows := read_history(run_file)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    by_step = {r["_step"]: r for r in rows}
    assert sorted(by_step) == [0, 1, 2]
    for s in range(3):
        for key in (
            "reward_mean",
            "reward_std",
            "loss",
            "grad_norm",
            "kl",
            "trained_tokens",
            "exception_rate",
        ):
            assert by_step[s][f"train/{key}"] == pytest.approx(history[s][key])
    assert by_step[2]["val/reward_mean"] == pytest.approx(0.5)
    assert by_step[2]["train/trajectories/_type"] == "table-file"  # nested keys come back flattened
    (table_file,) = run_dir.glob("files/media/table/train/trajectories_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:5] == ["step", "split", "group", "index", "reward"]
    assert [row[4] for row in table["data"]] == [1.0, 0.0]


def test_wandb_failure_warns_and_becomes_noop(monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from art_adapters.tracing.wandb import WandbLogger

    def broken_init(**kwargs: Any) -> None:
        raise wandb.errors.UsageError("no network, no API key")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(RuntimeWarning, match="W&B logging disabled"):
        logger = WandbLogger("art-test")
    assert logger.log_step(0, {"loss": 1.0}) == {"train/loss": 1.0}
    assert logger.log_trajectories(0, sample_groups()) == 3
    logger.finish()


def test_weave_op_rollout_still_captures_without_init():
    """weave never gets imported by us; a `@weave.op` rollout runs unchanged (no weave.init: it needs a server)."""
    weave = pytest.importorskip("weave")
    from art_adapters.capture import RecordingTransport, capture
    from art_adapters.testing import Reply, ScriptedServer

    @weave.op
    def rollout(base_url: str) -> str:
        import httpx
        import openai

        http = httpx.Client(transport=RecordingTransport())
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=http)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return answer.choices[0].message.content or ""

    with ScriptedServer([Reply(content="hello")]) as server, capture() as trajectory:
        assert rollout(server.base_url) == "hello"
    assert len(trajectory.llm_calls) == 1
    assert trajectory.llm_calls[0].response_message()["content"] == "hello"
