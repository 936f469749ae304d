"""RemoteBackend: the Backend protocol over HTTP to an `art-adapters serve` host, interchangeable with
LocalBackend behind `await model.register(backend)`."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from .base import ARTTraining, InferenceEndpoint

if TYPE_CHECKING:
    from ..config import SFTConfig, TrainConfig
    from ..model import Model, TrainableModel
    from ..trajectories import Trajectory, TrajectoryGroup

API_KEY_ENV = "ART_ADAPTERS_API_KEY"


class RemoteBackendError(RuntimeError):
    """The server refused or failed a call; `status` is the HTTP status (None when the connection failed)."""

    def __init__(self, message: str, *, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class RemoteBackend(ARTTraining):
    """A Backend served by `art-adapters serve` at `base_url`; inference goes through the same URL (`/v1`).

    `api_key` defaults to the env var ART_ADAPTERS_API_KEY. `timeout_s` bounds each plain call and the silence
    between two progress lines of a training step (the server sends heartbeats while a step runs);
    `register_timeout_s` bounds `register`, which may start the inference engine (and download the base model).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        register_timeout_s: float = 1800.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.timeout_s = timeout_s
        self.register_timeout_s = register_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r})"

    @property
    def client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a client is bound to the loop that made it
            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)),
            )
            self._loop = loop
        return self._client

    # ---- the protocol -------------------------------------------------------------------------------------

    async def register(self, model: Model) -> InferenceEndpoint:
        per_agent = getattr(model, "adapters", None)
        if per_agent is not None and not isinstance(per_agent.by, str):
            from ..agent_adapters import UnsupportedPerAgentSetting

            raise UnsupportedPerAgentSetting(
                f"model {model.name!r}: PerAgent(by={per_agent.model_dump()['by']}) is a function, and a function "
                "cannot travel to the server (the registration is JSON): use by='agent', 'node' or 'role' (with "
                "agents=[...] to pick agents), or a LocalBackend"
            )
        asked = model.inference_settings() if model.trainable else {}  # type: ignore[attr-defined]
        if asked:
            raise RemoteBackendError(
                f"model {model.name!r} asks for inference settings {sorted(asked)} (inference= or "
                "_internal_config.engine_args): on a remote backend they are the server's; start "
                "`art-adapters serve` with them"
            )
        data = await self._post(
            "/models/register", {"model": _payload(model)}, timeout_s=self.register_timeout_s
        )
        endpoint = InferenceEndpoint.model_validate(data)
        if not data.get("proxied", True):  # a plain Model's own endpoint, reached directly
            return endpoint
        # Inference goes to the URL this client already reaches the server on (a tunnel, a proxy), with the key
        # the server hands out for inference (its inference-only key when it has one).
        key = endpoint.api_key if endpoint.api_key not in ("", "none") else self.api_key or "none"
        _route_agents(model, data, endpoint.model_name)
        return endpoint.model_copy(update={"base_url": f"{self.base_url}/v1", "api_key": key})

    async def get_step(self, model: TrainableModel) -> int:
        answer = await self._post("/models/step", {"model": _payload(model)})
        _route_agents(model, answer)
        return int(answer["step"])

    async def train_events(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        body = {
            "model": _payload(model),
            "groups": [group.model_dump(mode="json") for group in groups],
            "config": config.model_dump(mode="json"),
            "record": record,
        }
        async for event in self._progress("/models/train", body, f"train of model {model.name!r}"):
            if event.get("event") == "done":
                _route_agents(model, event)
            yield event

    async def train_sft_events(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[dict[str, Any]]:
        body = {
            "model": _payload(model),
            "trajectories": [t.model_dump(mode="json") for t in trajectories],
            "config": config.model_dump(mode="json"),
        }
        async for event in self._progress("/models/train_sft", body, f"train_sft of model {model.name!r}"):
            yield event

    async def log(
        self,
        model: Model,
        groups: list[TrajectoryGroup],
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        body = {
            "model": _payload(model),
            "groups": [g.model_dump(mode="json") for g in groups],
            "split": split,
            "metrics": metrics or {},
            "step": step,
        }
        return dict((await self._post("/models/log", body))["metrics"])

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        body = {"model": _payload(model), "best_checkpoint_metric": best_checkpoint_metric}
        return [int(s) for s in (await self._post("/models/delete_checkpoints", body))["deleted"]]

    async def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's checkpoints on the server (each can be served with `serve_step`)."""
        return [
            int(s)
            for s in (await self._post("/models/checkpoint_steps", {"model": _payload(model)}))["steps"]
        ]

    async def serve_step(self, model: TrainableModel, step: int) -> str:
        """Have the server serve checkpoint `step` as its own version; returns the name that reaches it."""
        body = {"model": _payload(model), "step": step}
        return str((await self._post("/models/serve_step", body))["name"])

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except RuntimeError:  # its loop is gone
                pass
            self._client = None

    # ---- HTTP ---------------------------------------------------------------------------------------------

    async def _post(
        self, path: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        return await self._call("POST", path, body, timeout_s=timeout_s)

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        timeout = httpx.Timeout(timeout_s, connect=10.0) if timeout_s else httpx.USE_CLIENT_DEFAULT
        try:
            response = await self.client.request(
                method,
                path,
                content=_encode(body) if body is not None else None,
                headers={"content-type": "application/json"},
                timeout=timeout,
            )
        except httpx.TransportError as error:
            raise self._unreachable(path, error) from error
        if response.status_code >= 400:
            raise _http_error(path, response.status_code, response.content)
        try:
            return response.json()
        except ValueError as error:
            raise RemoteBackendError(
                f"{path}: the answer is not JSON (is {self.base_url} an art-adapters server?): {response.text[:200]!r}",
                status=response.status_code,
            ) from error

    async def _progress(self, path: str, body: dict[str, Any], what: str) -> AsyncIterator[dict[str, Any]]:
        """Stream the NDJSON progress of a step; the last event yielded is `done` (an `error` event raises)."""
        request = self.client.build_request(
            "POST", path, content=_encode(body), headers={"content-type": "application/json"}
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as error:
            raise self._unreachable(path, error) from error
        try:
            if response.status_code >= 400:
                raise _http_error(path, response.status_code, await response.aread())
            try:
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError as error:
                        raise RemoteBackendError(
                            f"{what}: a progress line is not JSON: {line[:200]!r}"
                        ) from error
                    kind = event.get("event")
                    if kind == "heartbeat":
                        continue
                    if kind == "error" and event.get("type") == "FutureVersionError":
                        from ..training.versions import FutureVersionError  # no torch: a light import

                        raise FutureVersionError(f"{what} refused by the server: {event.get('message')}")
                    if kind == "error":
                        raise RemoteBackendError(
                            f"{what} failed on the server: {event.get('type')}: {event.get('message')}",
                            detail=event,
                        )
                    yield event
                    if kind == "done":
                        return
            except httpx.TransportError as error:
                raise self._lost(what, error) from error
            raise self._lost(what, "the stream ended before the 'done' event")
        finally:
            await response.aclose()

    def _unreachable(self, path: str, error: Exception) -> RemoteBackendError:
        return RemoteBackendError(
            f"cannot reach the art-adapters server at {self.base_url} ({path}): {error!r}"
        )

    def _lost(self, what: str, error: object) -> RemoteBackendError:
        return RemoteBackendError(
            f"connection lost during {what} at {self.base_url}: {error!r}. The step may or may not have completed "
            "on the server; check `await model.get_step()` before retrying."
        )


def _payload(model: Model) -> dict[str, Any]:
    """The model as JSON; the endpoint fields of a trainable model are the server's to set."""
    exclude = {"inference_base_url", "inference_api_key"} if model.trainable else set()
    return model.model_dump(mode="json", exclude=exclude)


def _route_agents(model: Model, answer: dict[str, Any], model_key: str | None = None) -> None:
    """Per-agent adapters: capture routes each agent the server now serves (`answer["agents"]`) to its adapter
    under `model_key` (default: the name the model is served as, `{project}/{name}` before it is known)."""
    agents = answer.get("agents")
    if getattr(model, "adapters", None) is not None and isinstance(agents, list):
        key = model_key or model.inference_model_name or f"{model.project}/{model.name}"
        model.route_agents(key, [a for a in agents if isinstance(a, str)])  # type: ignore[attr-defined]


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _http_error(path: str, status: int, content: bytes) -> RemoteBackendError:
    if status == 401:
        return RemoteBackendError(
            f"{path}: 401 bad or missing API key (pass RemoteBackend(api_key=...) or set {API_KEY_ENV})",
            status=401,
        )
    try:
        detail: Any = json.loads(content).get("detail")
    except (ValueError, AttributeError):
        detail = content.decode(errors="replace")[:500]
    if status == 422 and isinstance(detail, list):
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg')}" for e in detail)
        return RemoteBackendError(f"{path}: 422 invalid request: {message}", status=422, detail=detail)
    return RemoteBackendError(f"{path}: {status} {detail}", status=status, detail=detail)
