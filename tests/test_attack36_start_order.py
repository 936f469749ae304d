"""Attack on ART's shared-GPU order at registration: when the trainer loads beside a running engine (asleep) and its
offload to CPU fails, the trainer must be closed (its memory freed) before the engine wakes into that memory, and
the offload's own error must reach the caller, not a wake-up failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import art_adapters as art
from art_adapters.backend import trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.tiny import tiny_model_path
from test_shared_gpu_order import FakeEngine, FakeTrainer, Ledger


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    ledger = Ledger()
    monkeypatch.setattr(torch.cuda, "empty_cache", ledger.empty_cache)
    return ledger


class StuckTrainer(FakeTrainer):
    def offload(self) -> None:
        raise RuntimeError("host memory exhausted while offloading")


async def test_a_failed_offload_closes_the_trainer_before_the_engine_wakes(
    tmp_path: Path, book: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = book
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 1)
    backend = LocalBackend(tmp_path / "art")
    backend._load_trainer = lambda model, directory: StuckTrainer(ledger)  # type: ignore[method-assign,assignment]
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))
    engine = FakeEngine(ledger, running=True)
    with pytest.raises(RuntimeError, match="offloading"):
        await backend._start(engine, model, tmp_path)  # type: ignore[arg-type]
    events: list[Any] = ledger.events
    assert events.index("close") < events.index("wake"), events
    assert ledger.engine_holds and not ledger.live and not ledger.on_gpu
