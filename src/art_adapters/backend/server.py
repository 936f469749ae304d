"""The HTTP server exposing a Backend to RemoteBackend clients: JSON routes, NDJSON progress, and the model's
OpenAI-compatible endpoint proxied at `/v1`, all behind one bearer key."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Discriminator, Field, Tag
from starlette.exceptions import HTTPException

from ..config import SFTConfig, TrainConfig
from ..inference.requests import RequestLimits
from ..model import Model, TrainableModel
from ..trajectories import MetadataValue, PydanticException, Trajectory, TrajectoryGroup
from .base import Backend, InferenceEndpoint
from .proxy import Guard, InferenceProxy

log = logging.getLogger("art_adapters.server")


DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
NDJSON = "application/x-ndjson"
T = TypeVar("T")


# ---- request bodies (validated by the data model; errors name the field) ------------------------------------


def _model_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "trainable" if value.get("trainable") or "base_model" in value else "plain"
    return "trainable" if isinstance(value, TrainableModel) else "plain"


AnyModel = Annotated[
    Annotated[TrainableModel, Tag("trainable")] | Annotated[Model, Tag("plain")], Discriminator(_model_kind)
]


class RegisterRequest(BaseModel):
    model: AnyModel


class GroupPayload(BaseModel):
    """A TrajectoryGroup on the wire, validated strictly (trajectories must be a list of Trajectory objects)."""

    trajectories: list[Trajectory]
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def group(self) -> TrajectoryGroup:
        return TrajectoryGroup(
            self.trajectories,
            exceptions=self.exceptions,
            metadata=self.metadata,
            metrics=self.metrics,
            logs=self.logs,
        )


class ModelRequest(BaseModel):
    model: TrainableModel


class TrainRequest(ModelRequest):
    groups: list[GroupPayload]
    config: TrainConfig = Field(default_factory=TrainConfig)
    record: bool = True


class SFTRequest(ModelRequest):
    trajectories: list[Trajectory]
    config: SFTConfig = Field(default_factory=SFTConfig)


class LogRequest(BaseModel):
    model: AnyModel
    groups: list[GroupPayload]
    split: str = Field(default="val", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    metrics: dict[str, float] = Field(default_factory=dict)
    step: int | None = Field(default=None, ge=0)


class StepRequest(ModelRequest):
    step: int = Field(ge=0)


class DeleteRequest(ModelRequest):
    best_checkpoint_metric: str | None = None


# ---- the app --------------------------------------------------------------------------------------------------


class _State:
    def __init__(self, backend: Backend, proxy: InferenceProxy, allowed_base_models: set[str]) -> None:
        self.backend = backend
        self.proxy = proxy
        self.allowed_base_models = allowed_base_models
        self.models: dict[tuple[str, str], Model] = {}
        self.endpoints: dict[tuple[str, str], InferenceEndpoint] = {}
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def check_allowed(self, model: Model) -> None:
        """A client chooses among the base models the operator allowed, and never the engine's settings (neither
        `inference=` nor ART's `_internal_config.engine_args`, whatever their values)."""
        if not isinstance(model, TrainableModel):
            return
        asked = model.inference_settings()  # an unknown engine arg raises here (a 400 naming it)
        if asked:
            raise HTTPException(
                403,
                f"inference settings {sorted(asked)} are the server's to choose; start "
                "`art-adapters serve` with them instead",
            )
        if _base_key(model.base_model) not in self.allowed_base_models:
            raise HTTPException(
                403,
                f"base model {model.base_model!r} is not allowed on this server (the operator allows them with "
                "`art-adapters serve --allow-base-model ...`)",
            )

    async def register(self, model: Model) -> InferenceEndpoint:
        key = (model.project, model.name)
        self.check_allowed(model)
        endpoint = await self.backend.register(model)
        model._backend = self.backend
        model.inference_base_url, model.inference_api_key = endpoint.base_url, endpoint.api_key
        self.models[key], self.endpoints[key] = model, endpoint
        if isinstance(model, TrainableModel):  # only what the backend serves is proxied (no relay to any URL)
            self.proxy.add(model.project, model.name, endpoint, agents=model.adapters is not None)
        return endpoint

    async def model(self, model: TrainableModel) -> TrainableModel:
        """The registered instance of the model (registering it first, e.g. after a server restart)."""
        known = self.models.get((model.project, model.name))
        if isinstance(known, TrainableModel):
            return known
        await self.register(model)
        return model

    def lock(self, model: Model) -> asyncio.Lock:
        return self.locks.setdefault((model.project, model.name), asyncio.Lock())


def create_app(
    backend: Backend,
    *,
    api_key: str | None,
    inference_key: str | None = None,
    allowed_base_models: Iterable[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    public_url: str | None = None,
    heartbeat_s: float = 15.0,
    proxy_read_timeout_s: float = 600.0,
    limits: RequestLimits | None = None,
    shutdown_grace_s: float = 120.0,
    record: Any = None,
    allowed_hosts: Iterable[str] = (),
) -> FastAPI:
    """The FastAPI app serving `backend`. `public_url` overrides the base URL handed to clients (default: the URL
    the request came in on); `heartbeat_s` is the idle gap after which a progress stream sends a heartbeat line.

    `api_key` opens every route, `inference_key` only `/v1/*` (and is the key handed to clients for inference;
    with an `api_key` and no `inference_key`, one is minted: the admin key is never handed out). Without an
    `api_key` only loopback names are served (`allowed_hosts` adds others, e.g. `public_url`'s).
    `allowed_base_models`: what clients may register (default: the base models of the models already on disk).
    `limits`: what one inference request may ask; `shutdown_grace_s`: how long shutdown waits for steps in flight.
    `record`: a LiveRecorder (record mode, backend/record.py): `/v1` calls are stored, `/rewards/{id}` joins rewards."""
    if api_key and inference_key == api_key:
        raise ValueError("the inference key must differ from the admin key (it is handed to every rollout)")
    if api_key and not inference_key:
        inference_key = "art-inference-" + secrets.token_urlsafe(24)
    allowed = set(allowed_base_models or ()) | registered_base_models(backend)
    proxy = InferenceProxy(limits=limits, read_timeout_s=proxy_read_timeout_s)
    state = _State(backend, proxy, {_base_key(b) for b in allowed})
    forward = proxy.forward
    if record is not None:
        from .record import recorded_forward

        forward = recorded_forward(proxy, record)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if state.tasks:  # let steps in flight finish (or fail) before the backend goes, for a bounded time
            _, late = await asyncio.wait(set(state.tasks), timeout=shutdown_grace_s)
            for task in late:
                log.warning(
                    "shutting down: %s did not finish within %.0f s; cancelled",
                    task.get_name(),
                    shutdown_grace_s,
                )
                task.cancel()
        await state.proxy.aclose()
        if record is not None:
            await forward.aclose()  # type: ignore[attr-defined]
        await backend.close()

    app = FastAPI(
        title="art-adapters backend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    hosts = set(allowed_hosts) | ({urlsplit(public_url).hostname or ""} if public_url else set())
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        inference_key=inference_key,
        allowed_hosts=hosts - {""},
        inference_max_body_bytes=proxy.limits.max_body_bytes,
    )
    app.state.art = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # The field and the reason, never the input echoed back (it may be huge, or not even UTF-8).
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
            for e in error.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": [f"{p}/{n}" for p, n in state.models], "training": len(state.tasks)}

    @app.post("/models/register")
    async def register(body: RegisterRequest, request: Request) -> dict[str, Any]:
        endpoint = await _checked(state.register(body.model))
        if not isinstance(body.model, TrainableModel):  # e.g. a judge on its own API: reached directly
            return {**endpoint.model_dump(), "proxied": False}
        base = (public_url or str(request.base_url)).rstrip("/")
        handed = inference_key or "none"  # rollouts sample with the key that cannot train
        answer = endpoint.model_copy(update={"base_url": f"{base}/v1", "api_key": handed})
        return {**answer.model_dump(), "proxied": True, **_agents(state, body.model)}

    @app.post("/models/step")
    async def get_step(body: ModelRequest) -> dict[str, Any]:
        # with the agents' adapters served now: a rollout worker that never trains routes new agents from here
        return {"step": await _checked(_step(backend, state, body.model)), **_agents(state, body.model)}

    @app.post("/models/train")
    async def train(body: TrainRequest) -> StreamingResponse:
        model = await _checked(state.model(body.model))
        groups = [g.group() for g in body.groups]
        check = getattr(backend, "check_train", None)  # refused before the stream starts: a 400 naming why
        if check is not None:
            await _checked(check(model, groups))

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for event in backend.train_events(model, groups, body.config, record=body.record):
                yield {**event, **_agents(state, model)} if event.get("event") == "done" else event

        return _progress(state, model, events, heartbeat_s)

    @app.post("/models/train_sft")
    async def train_sft(body: SFTRequest) -> StreamingResponse:
        model = await _checked(state.model(body.model))
        return _progress(
            state, model, lambda: backend.train_sft_events(model, body.trajectories, body.config), heartbeat_s
        )

    @app.post("/models/log")
    async def log_groups(body: LogRequest) -> dict[str, Any]:
        model = body.model
        if isinstance(model, TrainableModel):
            model = await _checked(state.model(model))
        groups = [g.group() for g in body.groups]
        metrics = await _checked(
            backend.log(model, groups, body.split, metrics=body.metrics or None, step=body.step)
        )
        return {"metrics": metrics}

    @app.post("/models/delete_checkpoints")
    async def delete_checkpoints(body: DeleteRequest) -> dict[str, list[int]]:
        model = await _checked(state.model(body.model))
        async with state.lock(model):
            deleted = await _checked(backend.delete_checkpoints(model, body.best_checkpoint_metric))
        return {"deleted": list(deleted)}

    @app.post("/models/checkpoint_steps")
    async def checkpoint_steps(body: ModelRequest) -> dict[str, list[int]]:
        model = await _checked(state.model(body.model))
        return {"steps": list(await _checked(_serving(backend).checkpoint_steps(model)))}

    @app.post("/models/serve_step")
    async def serve_step(body: StepRequest) -> dict[str, str]:
        """Serve an older checkpoint as its own version (an evaluation's way to any step)."""
        model = await _checked(state.model(body.model))
        return {"name": await _checked(_serving(backend).serve_step(model, body.step))}

    @app.get("/v1/models")
    async def list_models() -> Any:
        return state.proxy.list_models()

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def inference(path: str, request: Request) -> Any:
        return await forward(request, path)

    if record is not None:
        app.add_route("/rewards/{trajectory_id}", record.reward_endpoint, methods=["POST"])
        app.add_route("/rewards/{trajectory_id}/calls/{n}", record.call_reward_endpoint, methods=["POST"])

    return app


_END = object()


def _agents(state: _State, model: Model) -> dict[str, Any]:
    """Per-agent adapters: the agents' adapters the server serves now (`{"agents": [...]}`), so the client routes
    each agent's calls to `{project}/{name}.{adapter}`; nothing for a model without them."""
    known = state.models.get((model.project, model.name), model)
    routing = known.agent_routing() if isinstance(known, TrainableModel) else None
    if routing is None:
        return {}
    return {"agents": sorted(routing.served)}


def _base_key(base_model: str) -> str:
    """How base models are compared: a local folder by its resolved path, a hub id as written."""
    path = Path(base_model).expanduser()
    return str(path.resolve()) if path.exists() else base_model


def registered_base_models(backend: Backend) -> set[str]:
    """The base models of the models already registered in a LocalBackend's folder (`*/models/*/model.json`)."""
    root = getattr(backend, "path", None)
    found: set[str] = set()
    if root is None:
        return found
    for record in Path(root).glob("*/models/*/model.json"):
        try:
            base = json.loads(record.read_text()).get("base_model")
        except (OSError, ValueError):
            continue
        if isinstance(base, str):
            found.add(base)
    return found


async def _checked(awaitable: Awaitable[T]) -> T:
    """Backend failures as HTTP errors with the backend's message: ValueError -> 400, anything else -> 500."""
    try:
        return await awaitable
    except HTTPException:
        raise
    except ValueError as error:
        raise HTTPException(400, f"{type(error).__name__}: {error}") from error
    except Exception as error:
        log.exception("backend call failed")
        raise HTTPException(500, f"{type(error).__name__}: {error}") from error


def _serving(backend: Backend) -> Any:
    """The backend, if it serves older steps (LocalBackend does); else a 400 saying so."""
    if not (hasattr(backend, "checkpoint_steps") and hasattr(backend, "serve_step")):
        raise HTTPException(
            400, f"{type(backend).__name__} cannot serve older steps; evaluate its newest only"
        )
    return backend


async def _step(backend: Backend, state: _State, model: TrainableModel) -> int:
    """The step needs no registration (it is on disk): a restarted server answers without starting an engine."""
    known = state.models.get((model.project, model.name))
    return await backend.get_step(known if isinstance(known, TrainableModel) else model)


def _progress(state: _State, model: Model, start: Any, heartbeat_s: float) -> StreamingResponse:
    """Run the step in a task of its own (a client that goes away does not cut it short) and stream its events
    as NDJSON; the stream ends with the `done` event or an `error` event."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        done = False
        try:
            async with state.lock(model):
                async for event in start():
                    done = done or event.get("event") == "done"
                    queue.put_nowait(event)
            if not done:
                queue.put_nowait(
                    {"event": "error", "type": "RuntimeError", "message": "step ended without 'done'"}
                )
        except Exception as error:
            log.exception("step of %s/%s failed", model.project, model.name)
            queue.put_nowait({"event": "error", "type": type(error).__name__, "message": str(error)})
        finally:
            queue.put_nowait(_END)

    task = asyncio.create_task(pump(), name=f"step-{model.project}/{model.name}")
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)

    async def lines() -> AsyncIterator[bytes]:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), heartbeat_s)
            except TimeoutError:
                item = {"event": "heartbeat"}
            if item is _END:
                return
            yield json.dumps(item, default=_jsonable).encode() + b"\n"

    return StreamingResponse(lines(), media_type=NDJSON, headers={"cache-control": "no-cache"})


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


__all__ = [
    "create_app",
    "registered_base_models",
]
