"""The server's HTTP plumbing: the Guard (bearer key, body limits) and the OpenAI-compatible `/v1` pass-through,
which routes each request by its `model` to the backend's inference server and streams the answer unbuffered."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..agent_adapters import is_adapter_name
from ..calls import KEY_SCOPE_HEADER
from ..inference.forward import Forwarded, end_to_end_headers, openai_error
from ..inference.requests import RequestLimits, RequestRejected, parse_request, read_body
from ..untrusted import names_loopback, parse_step
from .base import InferenceEndpoint


class Guard:
    """ASGI middleware: 401 without a right `Authorization: Bearer KEY`, 413 for bodies over the limit
    (declared Content-Length, and bytes counted as they stream in).

    Two keys: the admin key opens every route; the inference key (rollout workers, Ray tasks) opens only the
    OpenAI-compatible `/v1/*` routes, so its holder can sample but never register, train or delete. An answer to
    the admin key says so (`x-art-key-scope: admin`), so a forwarder can refuse to carry it.

    Without a key (loopback only) a request must name this machine's loopback in `Host` (and in `Origin`, when a
    browser sends one): a web page whose name was rebound to 127.0.0.1 is refused."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        inference_key: str | None = None,
        allowed_hosts: Iterable[str] = (),
        inference_max_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.inference_max_body_bytes = inference_max_body_bytes  # `/v1/*`: an inference request's own bound
        self.key = api_key.encode() if api_key else None
        self.inference_key = inference_key.encode() if inference_key else None
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = {h.lower() for h in allowed_hosts}

    def role(self, scope: Scope) -> str | None:
        """ "admin", "inference" or None (no valid key), for the request's bearer token."""
        if self.key is None:
            return "admin"
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        admin = hmac.compare_digest(token, self.key)
        inference = self.inference_key is not None and hmac.compare_digest(token, self.inference_key)
        return "admin" if admin else "inference" if inference else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is None and not self.from_loopback(scope):
            await _send_json(send, 403, {"detail": "Host or Origin not allowed on this keyless server"})
            return
        role = self.role(scope)
        if role is None:
            await _send_json(
                send, 401, {"detail": "bad or missing API key"}, [(b"www-authenticate", b"Bearer")]
            )
            return
        if role == "inference" and not str(scope.get("path", "")).startswith("/v1/"):
            await _send_json(send, 403, {"detail": "the inference key only opens /v1/* (inference) routes"})
            return
        limit = self.max_body_bytes
        if str(scope.get("path", "")).startswith("/v1/") and self.inference_max_body_bytes is not None:
            limit = min(limit, self.inference_max_body_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _send_json(send, 413, {"detail": f"request body over the {limit}-byte limit"})
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body over the {limit}-byte limit")
            return message

        if role == "admin" and self.key is not None:
            send = _with_header(send, KEY_SCOPE_HEADER.encode(), b"admin")
        await self.app(scope, counted, send)

    def from_loopback(self, scope: Scope) -> bool:
        """Whether the request names a loopback host (or an allowed one) in `Host` and, if sent, in `Origin`."""
        headers = dict(scope.get("headers") or [])
        host, origin = headers.get(b"host"), headers.get(b"origin")
        return names_loopback(
            host.decode("latin-1") if host is not None else None,
            origin.decode("latin-1") if origin is not None else None,
            self.allowed_hosts,
        )


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sending


async def _send_json(
    send: Send, status: int, body: dict[str, Any], extra: list[tuple[bytes, bytes]] = ()
) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


# The inference server's routes a client may reach through the proxy; everything else (vLLM's LoRA loading,
# sleep, collective_rpc, cache resets, `..` tricks) is refused before any upstream call.
INFERENCE_PATHS = frozenset({"chat/completions", "completions", "responses", "messages"})


@dataclass
class ModelRoute:
    """Where one registered model (`key` = `{project}/{name}`) is served, and the name its upstream knows it by."""

    key: str
    name: str
    endpoint: InferenceEndpoint
    agents: bool = False  # per-agent adapters: `{key}.{adapter}` (and `{name}.{adapter}`) reach them too


class InferenceProxy:
    """Forwards `/v1/{chat/completions, completions, responses, messages}` to the endpoint of the registered model
    a request names (`{project}/{name}`, `@step`, or the bare `name` while one project alone uses it), rewriting
    `model` to the name that endpoint serves. Requests are checked as the gateway checks them (size, nesting,
    work, no engine fields); a client that goes away cancels its upstream request."""

    def __init__(
        self,
        *,
        limits: RequestLimits | None = None,
        read_timeout_s: float = 600.0,
        max_connections: int = 2048,
    ) -> None:
        self.limits = limits or RequestLimits()
        self.routes: dict[str, ModelRoute] = {}
        self.claims: dict[str, set[str]] = {}  # bare name -> the model keys that use it
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    # ---- routing table ---------------------------------------------------------------------------------------

    def add(self, project: str, name: str, endpoint: InferenceEndpoint, *, agents: bool = False) -> None:
        key = f"{project}/{name}"
        self.routes[key] = ModelRoute(key=key, name=name, endpoint=endpoint, agents=agents)
        self.claims.setdefault(name, set()).add(key)

    def remove(self, project: str, name: str) -> None:
        key = f"{project}/{name}"
        if self.routes.pop(key, None) is not None:
            keys = self.claims.get(name, set())
            keys.discard(key)
            if not keys:
                self.claims.pop(name, None)

    def resolve(self, requested: str) -> tuple[ModelRoute, str] | str:
        """The route a requested name means and the model name to send upstream, or why none (a message that
        names no other model). A per-agent model's agents are `{project}/{name}.{adapter}` (or `{name}.{adapter}`),
        the adapter a valid adapter name: the upstream gateway then answers for the versions it serves."""
        base, at, step = requested.partition("@")
        route, adapter = self._route(base), ""
        if route is None:
            owners = [k for k, r in self.routes.items() if r.agents] + (
                [] if "/" in base else list(self.claims)
            )
            owner = max((o for o in owners if base.startswith(o + ".")), key=len, default=None)
            route = self._route(owner) if owner is not None else None
            if isinstance(route, ModelRoute) and not route.agents:
                route = None
            elif isinstance(route, ModelRoute):
                adapter = base[len(owner) + 1 :]  # type: ignore[arg-type]
                if not is_adapter_name(adapter):
                    return f"model {requested!r} is not registered on this server ({adapter!r} is not an adapter name)"
        if isinstance(route, str):
            return route
        if route is None:
            return f"model {requested!r} is not registered on this server"
        if at and parse_step(step) is None:  # ASCII digits only: `model@²` is no step
            return f"model {requested!r} is not registered on this server (no such step)"
        upstream = route.endpoint.model_name + (f".{adapter}" if adapter else "")
        return route, upstream + (f"@{step}" if at else "")

    def _route(self, base: str) -> ModelRoute | str | None:
        """The route of `{project}/{name}` or of a bare `name` one project alone uses (else a message why not)."""
        route = self.routes.get(base)
        if route is None and "/" not in base:
            keys = self.claims.get(base, set())
            if len(keys) > 1:
                return f"model {base!r} is used by more than one project on this server; ask for '{{project}}/{base}'"
            route = self.routes.get(next(iter(keys))) if keys else None
        return route

    # ---- forwarding ------------------------------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10.0, read=self._read_timeout_s, write=60.0, pool=None),
                limits=httpx.Limits(
                    max_connections=self._max_connections,
                    max_keepalive_connections=min(512, self._max_connections),
                    keepalive_expiry=30.0,
                ),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def list_models(self) -> Response:
        """`GET /v1/models`: the registered models' names (bare names where one project alone uses them); never
        the base models, other adapters or anything about where they live."""
        names = set(self.routes) | {name for name, keys in self.claims.items() if len(keys) == 1}
        data = [{"id": n, "object": "model", "owned_by": "art-adapters"} for n in sorted(names)]
        return JSONResponse({"object": "list", "data": data})

    async def forward(self, request: Request, path: str) -> Response:
        if path not in INFERENCE_PATHS or request.method != "POST":
            return openai_error(404, f"/v1/{path} is not served here (inference routes only)", "not_found")
        try:
            payload = parse_request(await read_body(request, self.limits.max_body_bytes), self.limits)
        except RequestRejected as error:
            return openai_error(error.status, str(error))
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=499)
        requested = payload.get("model") or ""
        target = self.resolve(requested)
        if isinstance(target, str):
            return openai_error(404, target, "not_found")
        route, upstream_name = target
        payload["model"] = upstream_name
        headers = end_to_end_headers(request.headers)
        if route.endpoint.api_key:
            headers["authorization"] = f"Bearer {route.endpoint.api_key}"
        upstream = self.client.build_request(
            "POST",
            _join(route.endpoint.base_url, path),
            params=request.query_params,
            headers=headers,
            json=payload,
        )
        return Forwarded(self.client, upstream, requested=requested)


def _join(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + "/" + path.lstrip("/")
