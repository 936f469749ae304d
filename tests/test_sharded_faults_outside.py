"""A sharded trainer under the faults an outside attacker found, with real processes and gloo: a rank hung in a
load or a memory report takes the group down within collective_timeout_s (not the control group's 30 min); a
save that fails or whose caller is cancelled drops the trainer and the next step trains on from the last complete
checkpoint; a heartbeat timeout shorter than two beats is refused; a TMPDIR too long for a Unix socket still works
and leaves nothing behind."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.serving import Registered
from art_adapters.config import ShardedTrainerOptions, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.sharded import ShardedTrainer, TrainerProcessError
from test_sharded_faults import FAST, Host, _Gateway, _Server, faults, single_trainer  # noqa: F401
from test_sharded_training import HEAD, LR
from test_trainer import rollouts

pytestmark = pytest.mark.train
BOUND_S = (
    120.0  # far above collective_timeout_s (8 s) + the heartbeat grace, far below CONTROL_TIMEOUT_S (30 min)
)


def _bounded(call: Any) -> BaseException | None:
    """Run `call` in a thread; what it raised, after failing the test if it ran past BOUND_S."""
    outcome: list[BaseException | None] = []

    def go() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"the call still ran after {BOUND_S:.0f} s"
    return outcome[0]


@pytest.mark.parametrize("op", ["load", "memory"])
def test_a_rank_hung_in_a_load_or_memory_report_takes_the_group_down(
    faults: Path,  # noqa: F811 (the fixture, imported)
    tmp_path: Path,
    op: str,
) -> None:
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, options=FAST)
    try:
        trainer.save(tmp_path / "checkpoint")
        faults.write_text(f"hang 1 {op}")
        call = {"load": lambda: trainer.load(tmp_path / "checkpoint"), "memory": trainer.memory}[op]
        error = _bounded(call)
        assert isinstance(error, TrainerProcessError), error
        assert not trainer.alive
        assert all(p.poll() is not None for p in trainer._ranks.processes.values())
    finally:
        trainer.close()


def _state(tmp_path: Path) -> Registered:
    model = art.TrainableModel(name="s", project="p", base_model=str(tiny_model_path()), lora=HEAD)
    return Registered(model, tmp_path / "model", _Server(), _Gateway(), None, 0, asyncio.Lock())  # type: ignore[arg-type]


async def test_a_failed_or_cancelled_save_drops_the_trainer_and_the_next_step_trains_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, host = _state(tmp_path), Host()
    config = TrainConfig(learning_rate=LR, micro_batch_tokens=64)
    groups = rollouts(single_trainer(), seed=4)
    save = checkpoints.save_checkpoint

    async def step() -> None:
        async with state.lock:
            await host._run_trainer(state, lambda t: t.train_step(groups, config), save=lambda m: False)

    await step()
    assert state.step == 1

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "save_checkpoint", disk_full)
    first = state.trainer
    assert first is not None
    with pytest.raises(OSError, match="No space"):
        await step()
    assert state.trainer is None and not first.alive and state.step == 1  # at a step no checkpoint holds
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)
    await step()  # reloaded from checkpoint 1
    assert state.step == 2 and checkpoints.list_steps(state.directory) == [0, 1, 2]

    saving, release = threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        saving.set()
        release.wait(BOUND_S)
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_checkpoint", slow)
    second = state.trainer
    task = asyncio.ensure_future(step())
    assert await asyncio.to_thread(saving.wait, BOUND_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.trainer is None and state.step == 2
    release.set()  # the abandoned save completes checkpoint 3 on its own
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)
    await step()  # waits out the abandoned save, reloads checkpoint 3, trains step 4
    assert second is not None and not second.alive
    assert state.step == 4 and checkpoints.list_steps(state.directory) == [0, 1, 2, 3, 4]
    assert state.trainer is not None and state.trainer.step == 4
    state.trainer.close()


def test_a_heartbeat_timeout_under_two_beats_is_refused() -> None:
    assert ShardedTrainerOptions(heartbeat_timeout_s=4.0).heartbeat_timeout_s == 4.0
    for value in (1.5, 3.9, float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="heartbeat_timeout_s"):
            ShardedTrainerOptions(heartbeat_timeout_s=value)


def test_a_tmpdir_too_long_for_a_unix_socket_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = tmp_path / ("x" * 110)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, options=FAST)
    folder = trainer._folder
    try:
        assert folder.parent == Path("/tmp") and (folder.stat().st_mode & 0o777) == 0o700
        assert trainer.logprobs_of([1, 2, 3])
    finally:
        trainer.close()
    assert not folder.exists() and not list(long.glob("art-trainer-*"))


def test_a_damaged_checkpoint_is_an_error_every_rank_agrees_on(tmp_path: Path) -> None:
    import shutil

    import torch

    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, options=FAST)
    try:
        trainer.train_step(
            rollouts(single_trainer(), seed=4), TrainConfig(learning_rate=LR, micro_batch_tokens=64)
        )
        good = trainer.save(tmp_path / "good")
        damages = {
            "step": lambda s: s.__setitem__("step", "seven"),
            "index": lambda s: s["optimizer"]["state"].__setitem__(999, s["optimizer"]["state"][0]),
            "rng": lambda s: s.__setitem__("rng", torch.zeros(7, dtype=torch.uint8)),
        }
        for name, damage in damages.items():
            folder = tmp_path / name
            shutil.copytree(good, folder)
            saved = torch.load(folder / "optimizer.pt", weights_only=True)
            damage(saved)
            torch.save(saved, folder / "optimizer.pt")
            error = _bounded(lambda folder=folder: trainer.load(folder))
            assert isinstance(error, TrainerProcessError) and "ValueError" in str(error), (name, error)
            assert trainer.alive and trainer.step == 1, name
        trainer.load(good)
        assert trainer.alive and trainer.step == 1
    finally:
        trainer.close()


def test_the_weights_fingerprint_sees_a_tensor_past_the_first_mib(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from art_adapters.training.weights import weights_fingerprint

    generator = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(1024, 512, generator=generator), "b.weight": torch.randn(512, 512)}
    folders = [tmp_path / "base", tmp_path / "merged"]
    for folder, shift in zip(folders, (0.0, 0.5), strict=True):
        folder.mkdir()
        save_file({**tensors, "b.weight": tensors["b.weight"] + shift}, str(folder / "model.safetensors"))
    assert weights_fingerprint(folders[0]) != weights_fingerprint(folders[1])
    assert weights_fingerprint(folders[0]) == weights_fingerprint(folders[0])
