"""A recording endpoint: an OpenAI-compatible base URL per rollout, for agents the in-process hook cannot see (another
process, another language). Each call to `http://127.0.0.1:PORT/rollouts/{id}/v1/...` is forwarded to the model's
endpoint through the recording transport, inside the capture scope that URL was issued for: the same records,
token ids, sources and chaining as in-process capture.

    endpoint = RecordingEndpoint(model.inference_base_url, model.inference_api_key).start()
    async with art.capture() as trajectory:
        run_node_agent(base_url=endpoint.url())     # any OpenAI / Anthropic client, any language
    endpoint.stop()

The rollout id is a random capability (the only key a local agent needs); the upstream key never leaves this
process. A client that cannot change its base URL per rollout may use `endpoint.base_url` and send the id in an
`x-art-rollout` header (`endpoint.rollout_id()`). `x-art-role` names the call's role, as `art.role(...)` does.

With `record=LiveRecorder(store)` (capture/live.py), calls to the shared base URL that name no rollout are
recorded as production traffic, and `POST /rewards/{trajectory_id}` (bearer `recorder.reward_key`) joins rewards.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any

import httpx

from ..sources import role
from ..trajectories import Trajectory
from .scope import CURRENT, current_trajectory
from .transport import AsyncRecordingTransport

_HOP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "authorization",
    "x-api-key",
}
_OURS = {"x-art-role", "x-art-rollout"}
_RECORDED = ("chat/completions", "completions", "responses", "messages")


class RecordingEndpoint:
    """Serves `/rollouts/{id}/v1/*` on 127.0.0.1 (a thread of its own) and forwards to `upstream` (`.../v1`)."""

    def __init__(
        self,
        upstream: str,
        api_key: str | None = None,
        *,
        port: int = 0,
        request_token_ids: bool = True,
        record: Any = None,
    ):
        self.upstream = upstream.rstrip("/")
        self.api_key = api_key
        self.request_token_ids = request_token_ids
        self.port = port
        self.recorder = record  # a LiveRecorder: record mode (see the module docstring)
        if record is not None:
            record.require_key()
        self._rollouts: dict[str, Trajectory] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._client: httpx.AsyncClient | None = None

    # --- issuing URLs --------------------------------------------------------------------------------------

    def url(self, trajectory: Trajectory | None = None) -> str:
        """The base URL (`.../v1`) whose calls are recorded into `trajectory` (default: the open capture scope's)."""
        return f"http://127.0.0.1:{self.port}/rollouts/{self.rollout_id(trajectory)}/v1"

    def rollout_id(self, trajectory: Trajectory | None = None) -> str:
        """A new id naming `trajectory` (default: the open capture scope's), for the URL path or `x-art-rollout`."""
        target = trajectory if trajectory is not None else current_trajectory(required=True)
        assert target is not None
        rollout = secrets.token_urlsafe(16)
        with self._lock:
            self._rollouts = {k: t for k, t in self._rollouts.items() if not t._sealed}  # ended scopes go
            self._rollouts[rollout] = target
        return rollout

    @property
    def base_url(self) -> str:
        """The shared base URL; each request names its rollout in an `x-art-rollout` header."""
        return f"http://127.0.0.1:{self.port}/v1"

    # --- serving -------------------------------------------------------------------------------------------

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        methods = ["GET", "POST"]
        routes = [
            Route("/rollouts/{rollout}/v1/{path:path}", self._forward, methods=methods),
            Route("/v1/{path:path}", self._forward, methods=methods),
        ]
        if self.recorder is not None:
            routes.append(Route("/rewards/{trajectory_id}", self.recorder.reward_endpoint, methods=["POST"]))
        return Starlette(routes=routes)

    async def _forward(self, request: Any, scratch: Trajectory | None = None) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.path_params["path"]
        rollout = request.path_params.get("rollout") or request.headers.get("x-art-rollout", "")
        if self.recorder is not None and scratch is None and not rollout:  # record mode: production traffic
            return await self.recorder.record(request, lambda into: self._forward(request, into))
        with self._lock:
            trajectory = scratch if scratch is not None else self._rollouts.get(rollout)
        if trajectory is None or trajectory._sealed:
            return JSONResponse(
                {"error": {"message": "no open rollout here: its capture scope ended, or the id is unknown"}},
                status_code=404,
            )
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _HOP | _OURS | {"accept-encoding"}
        }
        headers["accept-encoding"] = "identity"
        if self.api_key:  # Anthropic's clients send x-api-key, which vLLM also reads; one key, ours, goes on
            headers["authorization"] = f"Bearer {self.api_key}"
        body = await request.body()
        assert self._client is not None
        upstream = self._client.build_request(
            request.method,
            f"{self.upstream}/{path}",
            params=request.query_params,
            headers=headers,
            content=body,
        )
        token = CURRENT.set(trajectory if path in _RECORDED else None)
        try:
            with role(request.headers["x-art-role"]) if request.headers.get("x-art-role") else _nothing():
                response = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            message = f"the model's endpoint {self.upstream} did not answer: {type(error).__name__}: {error}"
            return JSONResponse({"error": {"message": message}}, status_code=502)
        finally:
            CURRENT.reset(token)
        passed = {k: v for k, v in response.headers.items() if k.lower() not in _HOP | {"content-encoding"}}

        async def chunks() -> Any:
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            finally:
                await response.aclose()  # ends the record (a stream cut short is recorded as such)

        return StreamingResponse(chunks(), status_code=response.status_code, headers=passed)

    def start(self) -> RecordingEndpoint:
        """Serve in a thread of its own (idempotent); returns once it answers."""
        if self._thread is not None:
            return self
        try:
            import starlette  # noqa: F401
            import uvicorn
        except ImportError as error:
            raise ImportError(
                "the recording endpoint needs starlette and uvicorn: pip install 'art-adapters[endpoint]'"
            ) from error

        if not self.port:
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = int(probe.getsockname()[1])
        config = uvicorn.Config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,  # outlives clients' idle pooled connections (openai's: 30 s), as the gateway's
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            transport = AsyncRecordingTransport(request_token_ids=self.request_token_ids)
            self._client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(600.0, connect=30.0))
            try:
                loop.run_until_complete(self._server.serve())
            finally:
                loop.run_until_complete(self._client.aclose())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"art-recording-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the recording endpoint did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(10)
        self._thread = None

    def __enter__(self) -> RecordingEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _nothing:  # noqa: N801 - a null context manager
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["RecordingEndpoint"]
