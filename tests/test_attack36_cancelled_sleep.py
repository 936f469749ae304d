"""Attack on ART's order when the engine's sleep is interrupted: `sleep(mode=wait)` drains rollouts in flight (up
to 600 s), so a caller may cancel the step (or the request may fail) while vLLM goes on to sleep server-side. The
step then raised with nothing waking the engine: every rollout after it failed until another step ran."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from art_adapters.backend.local import LocalBackend
from test_shared_gpu_order import FakeEngine, FakeTrainer, Ledger, shared_state, step_of


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    ledger = Ledger()
    monkeypatch.setattr(torch.cuda, "empty_cache", ledger.empty_cache)
    return ledger


class SlowSleep(FakeEngine):
    """vLLM asleep as soon as asked; the HTTP answer comes only once rollouts drain (here: never)."""

    async def sleep(self) -> None:
        await super().sleep()
        await asyncio.Event().wait()


class FailedSleep(FakeEngine):
    async def sleep(self) -> None:
        await super().sleep()
        raise TimeoutError("no answer from /sleep")


async def test_a_step_cancelled_during_the_engines_sleep_wakes_it(tmp_path: Path, book: Ledger) -> None:
    trainer = FakeTrainer(book)
    trainer.offload()
    book.empty_cache()
    state = shared_state(tmp_path, book, trainer)
    state.server = SlowSleep(book)  # type: ignore[assignment]
    task = asyncio.ensure_future(step_of(LocalBackend(tmp_path / "art"), state))
    for _ in range(100):
        await asyncio.sleep(0)
        if "sleep" in book.events:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert book.engine_holds, book.events


async def test_a_failed_sleep_request_leaves_the_engine_awake(tmp_path: Path, book: Ledger) -> None:
    trainer = FakeTrainer(book)
    trainer.offload()
    book.empty_cache()
    state = shared_state(tmp_path, book, trainer)
    state.server = FailedSleep(book)  # type: ignore[assignment]
    with pytest.raises(TimeoutError):
        await step_of(LocalBackend(tmp_path / "art"), state)
    assert book.engine_holds, book.events
