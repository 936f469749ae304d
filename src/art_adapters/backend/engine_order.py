"""LocalBackend's trainer moves in the shared GPU's order: the engine put to sleep, the trainer moved between devices,
the allocator's cache released, an abandoned step's trainer dropped; each awaited to its end even when cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ..inference import VLLMServer
    from ..training.sharded import ShardedTrainer
    from ..training.trainer import Trainer

T = TypeVar("T")


async def drop_abandoned(
    running: asyncio.Future[Any], trainer: Trainer | ShardedTrainer, engine: VLLMServer | None
) -> None:
    """Let an abandoned step's thread finish, then release its trainer (its update is in no checkpoint) and, when
    it shared the engine's GPU, wake the engine into the memory it freed."""
    await asyncio.gather(running, return_exceptions=True)
    try:
        await asyncio.to_thread(trainer.close)
    finally:
        if engine is not None:
            await asyncio.to_thread(release_memory)
            await engine.wake_up()


async def sleep_engine(engine: VLLMServer) -> None:
    """engine.sleep(); if it fails or is cancelled (vLLM may sleep all the same), a wake-up (a no-op when awake)."""
    try:
        await engine.sleep()
    except BaseException:
        with contextlib.suppress(Exception):
            await engine.wake_up()
        raise


async def to_the_end(work: Callable[[], T]) -> T:
    """`work()` in a thread, awaited to its end even when the caller is cancelled (re-raised after): a trainer
    half moved between devices, or loaded with no one holding it, is never left behind."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.gather(running, return_exceptions=True)
        raise


def move_trainer(trainer: Trainer | ShardedTrainer, way: str) -> None:
    """`trainer.offload()` / `.reload()`; a sharded trainer, whose processes hold their own GPUs, has neither."""
    method = getattr(trainer, way, None)
    if method is not None:
        method()


def release_memory() -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks to the device (a no-op without CUDA):
    what the engine's wake-up, or the trainer's reload, needs to find free. The collection runs only once CUDA is
    initialized: it frees no device memory otherwise, and a full collection costs 0.33 s in the demo's process (640k
    objects: the agent framework, vLLM's client, the trainer), twice a step or SFT batch."""
    try:
        import torch
    except ImportError:
        return
    if (
        torch.cuda.is_initialized()
    ):  # tensors held only by reference cycles hold device blocks until collected
        gc.collect()
    torch.cuda.empty_cache()  # does nothing before CUDA is initialized
