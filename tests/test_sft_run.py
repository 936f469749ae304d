"""The one-job SFT run (backend/sft_run.py, LocalBackend.train_sft_events) when its caller goes away: the run stops
before the model's lock is free, and the next step waits for its thread (the GPU ledger of test_shared_gpu_order)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

import art_adapters as art
from test_shared_gpu_order import SFT_ROWS, FakeTrainer, Ledger, offloaded, sft_backend


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    book = Ledger()
    monkeypatch.setattr(torch.cuda, "empty_cache", book.empty_cache)
    return book


async def test_closing_the_sft_events_stops_the_run_before_the_lock_is_released(
    tmp_path: Path,
    ledger: Ledger,
) -> None:
    trainer = offloaded(ledger)
    trainer.gate = threading.Event()  # batch 2 waits here
    backend, model = sft_backend(tmp_path, ledger, trainer)
    state = backend._registered(model)
    events = backend.train_sft_events(model, SFT_ROWS, art.SFTConfig(batch_size=2))
    assert [(await anext(events))["event"] for _ in range(2)] == ["started", "batch"]
    try:
        await events.aclose()  # the caller goes away during batch 2
        # the model's lock is free again: the run must already be stopped (abandoned), or a next call shares the
        # trainer with the running thread
        assert not state.lock.locked()
        assert state.abandoned is not None, "lock released while the SFT job still runs on the trainer"
    finally:
        trainer.gate.set()
        await asyncio.sleep(0.2)
        if state.abandoned is not None:
            await state.abandoned


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
