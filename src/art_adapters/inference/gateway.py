"""The gateway: the one door to a managed vLLM server. Served names resolve to immutable adapter versions, requests
are checked and bounded, versions are unloaded once nothing uses them, and a dead engine is restarted.

Versioned weights: step k of model `{project}/{name}` is the adapter `{project}/{name}@k`, loaded beside the
others under its own name and path and never changed. A request for `{project}/{name}` (or the bare `name`, while
one project alone uses it here) goes to the newest version; a request in flight finishes on the version it
started with (vLLM keys its prefix cache by adapter, so no stale prefix is ever served for a new one); an old
version stays loaded while it was used in the last `keep_old_s` seconds and the engine has room (least recently
used first out), and is loaded again on demand when asked by name. Loads and unloads never hold the table's lock
(`versions.py`), so no request waits on another version's load. Every answer says which version produced it
(`x-art-policy-version`, `x-art-served-model`).

It runs an ASGI server on 127.0.0.1 in a thread of its own (with its own event loop), so it outlives any one
`asyncio.run` of its user and keeps serving while a training step holds the caller's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..calls import SERVED_HEADER, VERSION_HEADER
from ..http_limits import ConnectionLimits, uvicorn_config
from .forward import Forwarded, end_to_end_headers, engine_dead, openai_error
from .process import find_free_port
from .requests import RequestLimits, RequestRejected, parse_request, read_body
from .routing import DP_RANK_HEADER, ROLLOUT_HEADER, Upstream, route
from .versions import ServedModel, Version, VersionTable
from .vllm_server import InferenceServerError, VLLMServer

log = logging.getLogger(__name__)
T = TypeVar("T")
INFERENCE_PATHS = frozenset({"chat/completions", "completions", "responses", "messages"})
WATCH_EVERY_S = 0.5  # how often the engine's process is checked


class Gateway:
    """Serves `server`'s adapters under their models' names (see the module docstring). Start it with `start()`
    (from any thread or loop); `base_url` and `api_key` are what clients use."""

    def __init__(
        self, server: VLLMServer, limits: RequestLimits | None = None, *, port: int | None = None
    ) -> None:
        self.server = server
        self.limits = limits or RequestLimits()
        self.connections = ConnectionLimits()  # connection cap and slow-client deadlines (set before start())
        self.api_key = "art-gw-" + secrets.token_urlsafe(24)
        self.port = find_free_port(port)
        self.table = VersionTable(self._load, self._unload, lambda: self.server.config.max_loras)
        self.in_flight = 0
        self.busy_s = 0.0  # seconds with at least one request in flight (engine not idle)
        self._busy_since: float | None = None
        self.started_at = time.monotonic()
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._uvicorn: Any = None
        self._client: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> Gateway:
        """Run the gateway in its own thread (idempotent); returns once it answers."""
        if self._thread is not None:
            return self
        import uvicorn

        started = threading.Event()
        config = uvicorn_config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            limits=self.connections,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,  # outlives the recording client's 30 s keep-alive
            timeout_graceful_shutdown=5,
        )
        self._uvicorn = uvicorn.Server(config)

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            self._ready = asyncio.Event()
            self._ready.set()
            loop.call_soon(started.set)
            watchdog = loop.create_task(self._watch_engine())
            try:
                loop.run_until_complete(self._uvicorn.serve())
            finally:
                watchdog.cancel()
                loop.run_until_complete(asyncio.gather(watchdog, return_exceptions=True))
                if self._client is not None:
                    loop.run_until_complete(self._client.aclose())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"art-gateway-{self.port}", daemon=True)
        self._thread.start()
        atexit.register(
            self.stop
        )  # before the engines are killed at exit (atexit runs last-in first): no restarts
        started.wait(30)
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        if not self._uvicorn.started:
            raise InferenceServerError(f"the inference gateway did not start on port {self.port}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (requests in flight get `timeout_s` to finish); the vLLM server is left as it is."""
        if self._thread is None:
            return
        atexit.unregister(self.stop)
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._uvicorn.force_exit = True
            self._thread.join(5)
        self._thread = None

    async def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the gateway's loop (where its table and the engine's management live)."""
        assert self._loop is not None, "gateway not started"
        if asyncio.get_running_loop() is self._loop:
            return await coroutine
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    # ---- versions -----------------------------------------------------------------------------------------------

    @property
    def models(self) -> dict[str, ServedModel]:
        return self.table.models

    @property
    def keep_old_s(self) -> float:
        """How long an old version stays loaded after its last use (while the engine has room)."""
        return self.table.keep_old_s

    @keep_old_s.setter
    def keep_old_s(self, seconds: float) -> None:
        self.table.keep_old_s = seconds

    async def publish(self, key: str, name: str, step: int, path: Path) -> str:
        """Serve step `step` of `key` (from the adapter folder `path`) and point the model's names at it; returns
        its adapter name. Older versions leave the engine once idle for `keep_old_s` (or it needs their room)."""
        return await self.call(self._publish(key, name, step, Path(path)))

    async def _publish(self, key: str, name: str, step: int, path: Path) -> str:
        await self._engine_ready()
        version, shared = await self.table.publish(key, name, step, path)
        if shared:
            log.warning(
                "model name %r is used by more than one project on this server: it is served only as "
                "'{project}/%s' (use model.get_inference_name())",
                name,
                name,
            )
        return version.adapter

    async def moved(self, key: str, step: int, path: Path) -> None:
        """Version `step` of `key` now lives in `path`, its weights unchanged (a step that trained nothing took
        over its folder): the engine keeps serving it from memory, and loads it from there when it must."""
        await self.call(self.table.moved(key, step, Path(path)))

    async def forget(self, key: str, steps: list[int] | None = None) -> None:
        """Stop serving `steps` of `key` (their checkpoints are gone), or the whole model (None)."""
        await self.call(self._forget(key, steps))

    async def _forget(self, key: str, steps: list[int] | None) -> None:
        for version in await self.table.forget(key, steps):
            await self.table.unload_if_idle(version, forgotten=True)  # one in flight is unloaded when it ends

    def adapter_name(self, key: str, step: int | None = None) -> str:
        """The adapter serving `key` at `step` (None: its newest version)."""
        return self.table.adapter_name(key, step)

    def resolve(self, requested: str) -> tuple[ServedModel, Version] | str:
        """The model and version a requested name means, or why it is not served (a message naming no others)."""
        return self.table.resolve(requested)

    async def _load(self, version: Version) -> None:
        """Load `version` into the engine; an engine that died during the load is waited for and asked again."""
        await self._engine_ready()
        try:
            await self.server.load_lora(version.adapter, version.path)
        except (httpx.TransportError, InferenceServerError):
            if not await self._restarted():
                raise
            await self.server.load_lora(version.adapter, version.path)

    async def _restarted(self) -> bool:
        """After a failed exchange with the engine: whether it had died and the watchdog brought it back."""
        assert self._ready is not None
        for _ in range(20):  # a dying engine's server can fail requests a few seconds before it exits
            if self.server.died or not self._ready.is_set():
                break
            await asyncio.sleep(WATCH_EVERY_S)
        else:
            return False
        deadline = time.monotonic() + 600.0
        while time.monotonic() < deadline:  # until the watchdog has it back (not merely noticed the death)
            if self._ready.is_set() and not self.server.died and self.server.running:
                return True
            await asyncio.sleep(WATCH_EVERY_S)
        return False

    async def _unload(self, version: Version) -> None:
        if version.adapter not in self.server.loras:
            return
        try:
            await self.server.unload_lora(version.adapter)
        except (
            InferenceServerError,
            httpx.HTTPError,
        ) as error:  # the engine may be restarting: forget it anyway
            log.warning("could not unload adapter %s: %s", version.adapter, error)
            self.server.loras.pop(version.adapter, None)

    # ---- requests -----------------------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path_params["path"]
        if path not in INFERENCE_PATHS:
            return openai_error(404, f"/v1/{path} is not served here (inference routes only)", "not_found")
        try:
            body = await read_body(request, self.limits.max_body_bytes)
            payload = parse_request(body, self.limits, context_tokens=self.server.config.max_model_len)
        except RequestRejected as error:
            return openai_error(error.status, str(error))
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=499)
        requested = payload.get("model") or ""
        if not await self._engine_ready(wait_s=300.0):
            return openai_error(503, "the inference engine is restarting; try again", "unavailable")
        async with self.table.lock:  # resolved and pinned at once: a pinned version never leaves the engine
            target = self.resolve(requested)
            if isinstance(target, str):
                return openai_error(404, target, "not_found")
            model, version = target
            self._began(version)
        try:
            return await self._forward(request, path, payload, requested, model, version)
        except BaseException:
            self._ended(model, version)
            raise

    async def _forward(
        self,
        request: Request,
        path: str,
        payload: dict[str, Any],
        requested: str,
        model: ServedModel,
        version: Version,
    ) -> Response:
        try:
            await self.table.ensure_loaded(version)  # an older version asked for by name: loaded again
        except (InferenceServerError, ValueError, OSError) as error:
            self._ended(model, version)
            log.warning(
                "could not load %s for a request: %s", version.adapter, error
            )  # paths stay in the log
            return openai_error(
                404, f"model {requested!r} cannot be served (its adapter did not load)", "not_found"
            )
        payload["model"] = version.adapter
        headers = {k: v for k, v in end_to_end_headers(request.headers).items() if k != DP_RANK_HEADER}

        rollout, sent = request.headers.get(ROLLOUT_HEADER), list[Upstream]()
        ready = self._ready  # cleared by the watchdog from a death until the restarted engine is back
        assert ready is not None

        def upstream() -> httpx.Request:
            """Routed each time (a restarted engine may listen elsewhere, a peer leave); a rollout sticks to one."""
            sent.append(target := route(self.server, rollout, version.adapter))
            key = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}  # none: no header
            url, sent_headers = f"{target.base_url}/{path}", {**headers, **target.headers, **key}
            return self.client.build_request(
                "POST", url, params=request.query_params, headers=sent_headers, json=payload
            )

        async def recover() -> httpx.Request | None:
            """The engine was not there to serve it: another host's is taken out of routing and the request goes
            to another engine; if the managed one died, wait for the watchdog to bring it back."""
            if (peer := sent[-1].peer) is not None:
                peer.take_out("did not answer a request")
                return upstream()
            await self._restarted()
            return upstream() if await self._engine_ready(wait_s=600.0) else None

        return Forwarded(
            self.client,
            upstream(),
            requested=requested,
            headers={VERSION_HEADER: str(version.step), SERVED_HEADER: version.adapter},
            on_done=lambda: self._ended(model, version),
            recover=recover,
            dead=engine_dead,
            gone=lambda: (  # the managed engine killed mid-request (a peer's death is not seen here)
                None if sent[-1].peer is not None else self.server.died or not ready.is_set()
            ),
            gone_within_s=20 * WATCH_EVERY_S,  # as `_restarted`: its server can drop requests before it exits
            retries=1 + len(getattr(self.server, "peers", [])),
        )

    def _began(self, version: Version) -> None:
        self.table.pin(version)
        self.in_flight += 1
        if self.in_flight == 1:
            self._busy_since = time.monotonic()

    def _ended(self, model: ServedModel, version: Version) -> None:
        """A request on `version` ended, however it ended (called exactly once per `_began`)."""
        self.table.unpin(version)
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self.busy_s += time.monotonic() - self._busy_since
            self._busy_since = None
        forgotten = model.versions.get(version.step) is not version or self.models.get(model.key) is not model
        if forgotten and version.in_flight == 0:
            asyncio.get_running_loop().create_task(self.table.unload_if_idle(version, forgotten=True))

    def busy_seconds(self) -> float:
        """Seconds so far with at least one request in flight (for the engine's idle fraction)."""
        return self.busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)

    def list_models(self) -> dict[str, Any]:
        data = [{"id": n, "object": "model", "owned_by": "art-adapters"} for n in self.table.names()]
        return {"object": "list", "data": data}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10.0, read=3600.0, write=60.0, pool=None),
                limits=httpx.Limits(
                    max_connections=4096, max_keepalive_connections=512, keepalive_expiry=30.0
                ),
            )
        return self._client

    # ---- the engine ---------------------------------------------------------------------------------------------

    async def _engine_ready(self, wait_s: float = 600.0) -> bool:
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    async def _watch_engine(self, every_s: float = WATCH_EVERY_S) -> None:
        """Restart the engine when it dies; its adapters come back at the versions they served."""
        assert self._ready is not None
        while True:
            await asyncio.sleep(every_s)
            if not self.server.died:
                await self.table.retire()  # old versions past their grace leave the engine
                continue
            code = self.server.process.poll() if self.server.process else None
            log.error(
                "the vLLM engine died (exit code %s); restarting it (log: %s)", code, self.server.log_path
            )
            self._ready.clear()
            started = time.perf_counter()
            try:
                reloaded = await self.server.restart()
            except Exception:  # a failed restart is logged; the next check tries again
                log.exception("restarting the vLLM engine failed")
                continue
            finally:
                if not self.server.died:
                    self._ready.set()
            log.warning(
                "the vLLM engine is back after %.1f s (%d adapter(s) reloaded, restart #%d)",
                time.perf_counter() - started,
                reloaded,
                self.server.restarts,
            )

    # ---- the ASGI app -------------------------------------------------------------------------------------------

    def app(self) -> Starlette:
        def authorized(request: Request) -> bool:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            )

        async def inference(request: Request) -> Response:
            if not authorized(request):
                return openai_error(401, "bad or missing API key", "authentication_error")
            return await self.handle(request)

        async def models(request: Request) -> Response:
            if not authorized(request):
                return openai_error(401, "bad or missing API key", "authentication_error")
            return JSONResponse(self.list_models())

        async def health(request: Request) -> Response:
            ready = self._ready is not None and self._ready.is_set() and self.server.running
            return JSONResponse(
                {"engine": "ready" if ready else "restarting"}, status_code=200 if ready else 503
            )

        return Starlette(
            routes=[
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/{path:path}", inference, methods=["POST"]),
                Route("/health", health, methods=["GET"]),
            ]
        )


def gateway_of(server: VLLMServer, limits: RequestLimits | None = None) -> Gateway:
    """The one gateway of `server` (started on first use; shared by every backend that serves from it)."""
    gateway = getattr(server, "_gateway", None)
    if gateway is None:
        gateway = Gateway(server, limits)
        server._gateway = gateway  # type: ignore[attr-defined]
    return gateway.start()


def stop_gateway(server: VLLMServer) -> None:
    """Stop `server`'s gateway, if it has one (before the server itself stops)."""
    gateway = getattr(server, "_gateway", None)
    if gateway is not None:
        gateway.stop()
        server._gateway = None  # type: ignore[attr-defined]
