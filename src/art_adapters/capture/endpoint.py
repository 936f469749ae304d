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
`x-art-rollout` header (`endpoint.rollout_id()`). `x-art-role` names the call's role, as `art.role(...)` does;
with `routing=model.agent_routing()` (per-agent adapters) that role picks the call's adapter (`PerAgent(by="role")`).

With `record=LiveRecorder(store)` (capture/live.py), calls to the shared base URL that name no rollout are
recorded as production traffic, and `POST /rewards/{trajectory_id}` (bearer `recorder.reward_key`) joins rewards
(`POST /rewards/{trajectory_id}/calls/{n}`: one call's reward).

A URL grants what is recorded, nothing more: POST to the four recorded routes, matched by exact path (no `..`,
no other route of the upstream's API), bodies bounded in size and JSON depth, the APIs' own headers only. It never
carries `serve`'s admin key (it refuses to start with one): give it the inference key serve hands out.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from typing import Any

import httpx

from ..agent_adapters import AgentRouting
from ..calls import KEY_SCOPE_HEADER
from ..http_limits import ConnectionLimits, uvicorn_config
from ..sources import role
from ..trajectories import Trajectory
from ..untrusted import forwarded_headers, is_loopback, nesting_depth
from .scope import CURRENT, current_trajectory
from .transport import AsyncRecordingTransport

RECORDED_ROUTES = ("chat/completions", "completions", "responses", "messages")  # POST only, exact paths
_ANSWER_HEADERS_DROPPED = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
}


class RecordingEndpoint:
    """Serves `/rollouts/{id}/v1/*` on 127.0.0.1 (a thread of its own) and forwards to `upstream` (`.../v1`).
    `max_body_bytes` and `max_depth` bound a request's body; `limits` the connections it serves."""

    def __init__(
        self,
        upstream: str,
        api_key: str | None = None,
        *,
        port: int = 0,
        request_token_ids: bool = True,
        max_body_bytes: int = 32 * 2**20,
        max_depth: int = 64,
        limits: ConnectionLimits | None = None,
        record: Any = None,
        routing: AgentRouting | None = None,
    ):
        self.upstream = upstream.rstrip("/")
        self.routing = (
            routing  # per-agent adapters: `model.agent_routing()` (each call to its agent's adapter)
        )
        self.api_key = api_key
        self.request_token_ids = request_token_ids
        self.port = port
        self.recorder = record  # a LiveRecorder: record mode (see the module docstring)
        if record is not None:
            record.require_key()
        self.max_body_bytes = max_body_bytes
        self.max_depth = max_depth
        self.limits = limits or ConnectionLimits()
        base = httpx.URL(self.upstream + "/")
        self._targets = {route: base.join(route) for route in RECORDED_ROUTES}
        self._models_url = base.join("models")
        self._refused: str | None = None  # set once the upstream says our key is its admin key
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

        routes = [
            Route("/rollouts/{rollout}/v1/{path:path}", self._forward, methods=["POST"]),
            Route("/v1/{path:path}", self._forward, methods=["POST"]),
        ]
        if self.recorder is not None:
            routes.append(Route("/rewards/{trajectory_id}", self.recorder.reward_endpoint, methods=["POST"]))
            routes.append(
                Route(
                    "/rewards/{trajectory_id}/calls/{n}", self.recorder.call_reward_endpoint, methods=["POST"]
                )
            )
        return Starlette(routes=routes)

    async def _forward(self, request: Any, scratch: Trajectory | None = None) -> Any:
        from starlette.responses import Response, StreamingResponse

        admitted = await self._admit(request, scratch)
        if not isinstance(admitted, tuple):
            return admitted
        trajectory, target, body = admitted
        headers = forwarded_headers(request.headers.items())
        headers["accept-encoding"] = "identity"
        if self.api_key:  # Anthropic's clients send x-api-key, which vLLM also reads; one key, ours, goes on
            headers["authorization"] = f"Bearer {self.api_key}"
        assert self._client is not None
        upstream = self._client.build_request(
            "POST", target, params=request.query_params, headers=headers, content=body
        )
        token = CURRENT.set(trajectory)
        try:
            with role(request.headers["x-art-role"]) if request.headers.get("x-art-role") else _nothing():
                sending = asyncio.ensure_future(self._client.send(upstream, stream=True))  # in this context
        finally:
            CURRENT.reset(token)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not sending.done():  # the agent hung up first (or we are cancelled): the upstream stops for it
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        if sending.cancelled():
            return Response(status_code=499)
        try:
            response = sending.result()
        except httpx.HTTPError as error:
            shown = _shown(self.upstream)
            detail = str(error).replace(self.upstream, shown)
            secret = httpx.URL(self.upstream).password
            detail = detail.replace(secret, "***") if secret else detail
            message = f"the model's endpoint {shown} did not answer: {type(error).__name__}: {detail}"
            return _error(502, message)
        if response.headers.get(KEY_SCOPE_HEADER) == "admin":
            await response.aclose()
            self._refused = _ADMIN_KEY
            return _error(403, _ADMIN_KEY)
        passed = {k: v for k, v in response.headers.items() if k.lower() not in _ANSWER_HEADERS_DROPPED}

        async def chunks() -> Any:
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            finally:
                await response.aclose()  # ends the record (a stream cut short is recorded as such)

        return StreamingResponse(chunks(), status_code=response.status_code, headers=passed)

    async def _admit(
        self, request: Any, scratch: Trajectory | None = None
    ) -> tuple[Trajectory, httpx.URL, bytes] | Any:
        """The open rollout a request records into (`scratch` in record mode), its upstream URL and its body; or
        the answer to send instead (an error, or in record mode the recorded production call's)."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        if self._refused is not None:
            return _error(403, self._refused)
        if not is_loopback(request.url.hostname or ""):
            return _error(403, "Host not allowed: this endpoint answers only its loopback address")
        target = self._targets.get(request.path_params["path"])
        if target is None:
            return _error(404, f"only POST to /v1/{{{', '.join(RECORDED_ROUTES)}}} is recorded here")
        rollout = request.path_params.get("rollout") or request.headers.get("x-art-rollout", "")
        production = self.recorder is not None and scratch is None and not rollout
        with self._lock:
            trajectory = scratch if scratch is not None else self._rollouts.get(rollout)
        if not production and (trajectory is None or trajectory._sealed):
            return _error(404, "no open rollout here: its capture scope ended, or the id is unknown")
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        except _Refused as refused:
            return _error(refused.status, str(refused))
        if production:  # record mode: production traffic, recorded under its trajectory
            return await self.recorder.record(request, body, lambda into: self._forward(request, into))
        assert trajectory is not None
        return trajectory, target, body

    async def _body(self, request: Any) -> bytes:
        """The request's body: at most `max_body_bytes`, a JSON object nested at most `max_depth` deep (read once:
        record mode admits a request twice)."""
        cached = getattr(request.state, "art_body", None)
        if cached is not None:
            return cached
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _Refused(413, f"request body over the {self.max_body_bytes}-byte limit")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refused(413, f"request body over the {self.max_body_bytes}-byte limit")
            chunks.append(chunk)
        body = b"".join(chunks)
        too_deep = _Refused(400, f"request body nested deeper than {self.max_depth} levels")
        try:
            payload = json.loads(body)
        except RecursionError:
            raise too_deep from None
        except ValueError:
            raise _Refused(400, "request body is not valid JSON") from None
        if nesting_depth(payload, self.max_depth) > self.max_depth:
            raise too_deep
        if not isinstance(payload, dict):
            raise _Refused(400, "request body must be a JSON object")
        request.state.art_body = body
        return body

    def _check_key(self) -> None:
        """Refuse `serve`'s admin key (its answers say so): a rollout URL must not carry the power to train."""
        if not self.api_key:
            return
        try:
            answer = httpx.get(
                self._models_url, headers={"authorization": f"Bearer {self.api_key}"}, timeout=10
            )
        except httpx.HTTPError:
            return  # not there yet: each answer is checked too
        if answer.headers.get(KEY_SCOPE_HEADER) == "admin":
            raise PermissionError(_ADMIN_KEY)

    def start(self) -> RecordingEndpoint:
        """Serve in a thread of its own (idempotent); returns once it answers."""
        if self._thread is not None:
            return self
        self._check_key()
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
        config = uvicorn_config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            limits=self.limits,
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
            transport = AsyncRecordingTransport(
                request_token_ids=self.request_token_ids, routing=self.routing
            )
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


_ADMIN_KEY = (
    "this key is the admin key of the server upstream (`art-adapters serve --api-key`): a rollout URL must not "
    "carry it; give the recording endpoint the inference key the server hands out (`model.inference_api_key`)"
)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class _nothing:  # noqa: N801 - a null context manager
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["RecordingEndpoint"]


async def _disconnected(receive: Any) -> None:
    """Returns when the client hangs up (its body was read already: the next ASGI message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _shown(url: str) -> str:
    """An upstream URL as an error may show it: no credentials, no query (a key can sit in either)."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(username=None, password=None, query=None, fragment=None))
