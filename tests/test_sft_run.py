"""An SFT run as one trainer job (backend/sft_run.py, LocalBackend.train_sft_events) against the shared GPU's ledger
of test_shared_gpu_order: one hand-over per run, each batch streamed, a failure after batch 1 drops the trainer, a
caller who goes away stops the run before the model's lock is free, and the next step waits for its thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

import art_adapters as art
from art_adapters.backend.local import LocalBackend
from test_shared_gpu_order import FakeTrainer, Ledger, offloaded, shared_state


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    book = Ledger()
    monkeypatch.setattr(torch.cuda, "empty_cache", book.empty_cache)
    return book


def sft_backend(
    tmp_path: Path, ledger: Ledger, trainer: FakeTrainer
) -> tuple[LocalBackend, art.TrainableModel]:
    backend = LocalBackend(tmp_path / "art")
    state = shared_state(tmp_path, ledger, trainer)
    state.directory = backend.model_dir(state.model)
    state.directory.mkdir(parents=True)
    backend._models[state.directory] = state
    return backend, state.model  # type: ignore[return-value]


SFT_ROWS = [
    art.Trajectory(
        messages_and_choices=[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    )
    for i in range(6)
]


async def test_an_sft_run_hands_the_gpu_over_once_and_streams_each_batch(
    tmp_path: Path, ledger: Ledger
) -> None:
    backend, model = sft_backend(tmp_path, ledger, offloaded(ledger))
    events = [e async for e in backend.train_sft_events(model, SFT_ROWS, art.SFTConfig(batch_size=2))]
    assert [e["event"] for e in events] == ["started", "batch", "batch", "batch", "done"]
    assert [e["loss"] for e in events[1:4]] == [1.0, 0.5, 1 / 3]
    assert events[-1]["metrics"]["final_loss"] == 1 / 3
    assert ledger.events == ["sleep", "empty_cache", "reload", "sft", "sft", "sft", "save", "offload",
                             "empty_cache", "wake", "load_adapter"]  # fmt: skip
    assert events[-1]["step"] == 1 and events[-1]["metrics"]["trained_tokens"] == 9


@pytest.mark.parametrize("batch", [1, 2])
async def test_an_sft_run_failing_drops_the_trainer_once_weights_moved(
    tmp_path: Path, ledger: Ledger, batch: int
) -> None:
    trainer = offloaded(ledger, fail=f"sft batch {batch}")
    backend, model = sft_backend(tmp_path, ledger, trainer)
    state = backend._registered(model)
    seen: list[str] = []
    with pytest.raises(
        RuntimeError, match="batch 2 of 3, after 1 batches" if batch == 2 else "out of memory"
    ):
        async for event in backend.train_sft_events(model, SFT_ROWS, art.SFTConfig(batch_size=2)):
            seen.append(event["event"])
    assert seen == (["started", "batch"] if batch == 2 else ["started"])
    assert ledger.events[-1] == "wake" and "save" not in ledger.events and state.step == 0
    # the first batch's failure moved nothing: the trainer stays
    assert (state.trainer is None) == (batch == 2)


async def test_a_caller_that_goes_away_stops_the_run_after_its_batch_before_the_lock_is_free(
    tmp_path: Path, ledger: Ledger
) -> None:
    trainer = offloaded(ledger)
    trainer.gate = threading.Event()  # batch 2 waits here
    backend, model = sft_backend(tmp_path, ledger, trainer)
    state = backend._registered(model)
    events = backend.train_sft_events(model, SFT_ROWS, art.SFTConfig(batch_size=2))
    assert [(await anext(events))["event"] for _ in range(2)] == ["started", "batch"]
    try:
        await events.aclose()  # the caller goes away during batch 2
        # the model's lock is free again, so the run must already be abandoned (the next call waits for it), or a
        # next call would share the trainer with the running thread
        assert not state.lock.locked()
        assert state.abandoned is not None, "lock released while the SFT job still runs on the trainer"
    finally:
        trainer.gate.set()
    await state.abandoned
    assert trainer.sft_batches == 2 and state.trainer is None and state.step == 0  # batch 3 never ran
    assert ledger.events[-3:] == ["close", "empty_cache", "wake"] and "save" not in ledger.events


async def test_a_step_right_after_a_closed_sft_run_waits_for_its_thread(
    tmp_path: Path,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = offloaded(ledger)
    trainer.gate = threading.Event()  # the SFT run's batch 2 waits here
    backend, model = sft_backend(tmp_path, ledger, trainer)
    state = backend._registered(model)
    monkeypatch.setattr(backend, "_load_trainer", lambda model, directory: FakeTrainer(ledger))
    first = backend.train_sft_events(model, SFT_ROWS, art.SFTConfig(batch_size=2))
    assert [(await anext(first))["event"] for _ in range(2)] == ["started", "batch"]
    await first.aclose()  # the caller goes away during batch 2 ...
    overlapped: list[bool] = []

    def work(t: FakeTrainer) -> dict:
        overlapped.append(not trainer.gate.is_set())  # the SFT thread still in batch 2
        return t.train_step(None, None)

    async def next_step() -> None:  # ... and, holding the model's lock as train_events does, takes a step
        async with state.lock:
            await backend._run_trainer(state, work, save=lambda m: False)

    second = asyncio.ensure_future(next_step())
    await asyncio.sleep(0.5)
    trainer.gate.set()
    await asyncio.gather(second, return_exceptions=True)
    if state.abandoned is not None:
        await state.abandoned
    assert ledger.most_live == 1, f"two trainers live at once: {ledger.events}"
    assert overlapped == [False], "the next step trained while the closed SFT run's thread still ran"
