"""Decorators rollout code wraps around its calls: `retry` with backoff, `limit_concurrency`, `log_http_errors`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import httpx

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger(__name__)


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[Exception, int], None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Call the function again when it raises one of `exceptions`, up to `max_attempts` calls in all, waiting
    `delay` seconds and then `backoff_factor` times longer each time; the last failure propagates.

    Works on sync and async functions. `on_retry(error, attempt)` runs before each wait.
    """
    if max_attempts < 1:
        raise ValueError(f"retry: max_attempts must be >= 1, not {max_attempts}")

    def waits() -> list[float]:
        return [delay * backoff_factor**i for i in range(max_attempts - 1)]

    def note(error: Exception, attempt: int, wait: float) -> None:
        if on_retry is not None:
            on_retry(error, attempt)
        log.debug("attempt %d failed (%s); retrying in %.2f s", attempt, error, wait)

    def decorator(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                for attempt, wait in enumerate(waits(), start=1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as error:  # type: ignore[misc]
                        note(error, attempt, wait)  # type: ignore[arg-type]
                        await asyncio.sleep(wait)
                return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def sync_wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            for attempt, wait in enumerate(waits(), start=1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as error:  # type: ignore[misc]
                    note(error, attempt, wait)  # type: ignore[arg-type]
                    time.sleep(wait)
            return fn(*args, **kwargs)

        return sync_wrapper

    return decorator


def limit_concurrency(
    n: int, derive_key: Callable[..., str] | None = None
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """At most `n` calls of the async function run at once (per `derive_key(*args, **kwargs)` when given)."""
    if n < 1:
        raise ValueError(f"limit_concurrency: n must be >= 1, not {n}")
    semaphores: dict[str, asyncio.Semaphore] = {}

    def decorator(fn: Callable[P, Any]) -> Callable[P, Any]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"limit_concurrency wraps async functions; {fn.__qualname__} is not one")

        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            key = derive_key(*args, **kwargs) if derive_key else "default"
            semaphore = semaphores.setdefault(key, asyncio.Semaphore(n))
            async with semaphore:
                return await fn(*args, **kwargs)

        return wrapper

    return decorator


class HTTPCallError(RuntimeError):
    """An HTTP error answer, with the status, the URL and the server's `detail`."""


def log_http_errors(fn: Callable[P, Any]) -> Callable[P, Any]:
    """Re-raise an `httpx.HTTPStatusError` from the async function as one line naming status, URL and detail."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
        try:
            return await fn(*args, **kwargs)
        except httpx.HTTPStatusError as error:
            try:
                detail = error.response.json().get("detail")
            except Exception:
                detail = error.response.text[:500]
            raise HTTPCallError(
                f"[HTTP {error.response.status_code}] {error.request.url} {detail}"
            ) from error

    return wrapper
