"""`art-adapters serve --record URL`: the server's `/v1` inference recorded into a trajectory store (the record mode of
capture/live.py), and `POST /rewards/{trajectory_id}` behind the server's admin key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request

from ..capture.live import LiveRecorder
from ..capture.transport import AsyncRecordingTransport
from .proxy import InferenceProxy

Forward = Callable[[Request, str], Awaitable[Any]]


def recorded_forward(proxy: InferenceProxy, recorder: LiveRecorder) -> Forward:
    """A `/v1` forwarder like `proxy.forward` (same routes, same checks on every request) whose upstream calls go
    through the recording transport, asking the engine for token ids and logprobs."""
    recording = InferenceProxy(limits=proxy.limits, read_timeout_s=proxy._read_timeout_s)
    recording.routes, recording.claims = (
        proxy.routes,
        proxy.claims,
    )  # one routing table: registrations reach both
    recording._client = httpx.AsyncClient(
        transport=AsyncRecordingTransport(request_token_ids=True),
        timeout=httpx.Timeout(connect=10.0, read=proxy._read_timeout_s, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=proxy._max_connections, keepalive_expiry=30.0),
        follow_redirects=False,
    )

    async def forward(request: Request, path: str) -> Any:
        return await recorder.record(
            request, await request.body(), lambda _scratch: recording.forward(request, path)
        )

    forward.aclose = recording.aclose  # type: ignore[attr-defined]
    return forward
