"""A sync rollout's attempt on its own daemon thread: as many run at once as the evaluation allows (asyncio's
default pool would cap them at min(32, cpus + 4)), and one still stuck after its attempt timed out keeps neither
`asyncio.run` nor the interpreter from ending (a thread cannot be stopped; it is left behind, not waited for)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any


async def in_daemon_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` on a new daemon thread, in a copy of this context (evaluation overrides reach it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the attempt timed out or was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = context.run(function, *args), None
        except BaseException as failed:  # handed to the awaiting task, as asyncio.to_thread does
            result, error = None, failed
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this attempt any more
            pass

    threading.Thread(target=run, name="art-adapters-eval-rollout", daemon=True).start()
    return await future
