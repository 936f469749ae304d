"""An SFT run as one trainer job: every batch in one thread, so a GPU shared with the engine is handed over once
per run (engine asleep, trainer on the GPU), not once per batch; each batch's loss streams out as an event."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..config import SFTConfig
from ..trajectories import Trajectory

Report = Callable[[dict[str, Any]], None]


class UnsavedWeights(RuntimeError):
    """A run failed after some batches had already updated the weights: no checkpoint holds them, so the trainer
    must be dropped and the next call reload the last checkpoint."""


def run_batches(
    trainer: Any,
    batches: list[list[Trajectory]],
    config: SFTConfig,
    report: Report,
    stop: threading.Event,
) -> dict[str, Any]:
    """`trainer.sft_step` on each batch at its learning rate (`config.rate`), reporting each batch's loss; then
    the step counter advances by one, so the run saves as one checkpoint. A set `stop` ends the run before its
    next batch, with the step left where it was. No batches: the step still advances (an unchanged checkpoint)."""
    losses: list[float] = []
    tokens = 0
    for i, batch in enumerate(batches):
        if stop.is_set():
            return {"stopped_after": i}
        settings = config.model_copy(update={"learning_rate": config.rate(i, len(batches))})
        try:
            part = trainer.sft_step(batch, settings)
        except Exception as error:
            if i == 0:
                raise
            raise UnsavedWeights(
                f"SFT failed at batch {i + 1} of {len(batches)}, after {i} batches had updated the weights "
                f"(dropped: the next call starts from the last checkpoint): {type(error).__name__}: {error}"
            ) from error
        losses.append(float(part.get("loss", 0.0)))
        tokens += int(part.get("trained_tokens", 0))
        report({"event": "batch", "batch": i + 1, "of": len(batches), "loss": losses[-1]})
    trainer.step += 1
    return {
        "loss": sum(losses) / max(len(losses), 1),
        "final_loss": losses[-1] if losses else 0.0,
        "batches": len(batches),
        "trained_tokens": tokens,
    }


async def streamed(
    start: Callable[[Report, threading.Event], Awaitable[dict[str, Any]]],
) -> AsyncIterator[dict[str, Any]]:
    """Run `start(report, stop)` and yield each event it reports (from its thread) as it comes, then
    `{"event": "result", "metrics": ...}`. Closed early (the caller stopped iterating, or was cancelled), the run
    is told to stop after its current batch and cancelled: nothing of it is saved, even when its last batch had
    already ended (an SFT run saves whole or not at all). Close it with its caller (`contextlib.aclosing`)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def report(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    running = asyncio.ensure_future(start(report, stop))
    waiting: asyncio.Future[dict[str, Any]] | None = None
    try:
        while not running.done():
            waiting = asyncio.ensure_future(events.get())
            await asyncio.wait({waiting, running}, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                yield waiting.result()
            else:
                waiting.cancel()
        while not events.empty():
            yield events.get_nowait()
        metrics = running.result()  # a failure raises here, after the events reported before it
        yield {"event": "result", "metrics": metrics}
    finally:
        if waiting is not None and not waiting.done():  # the caller was cancelled mid-wait
            waiting.cancel()
        if not running.done():
            stop.set()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
