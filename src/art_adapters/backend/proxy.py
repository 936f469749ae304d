"""The server's HTTP plumbing: the Guard (bearer key, body limits) and the OpenAI-compatible `/v1` pass-through,
which routes each request by its `model` to the backend's inference server and streams the answer unbuffered."""

from __future__ import annotations

import hmac
import json
from typing import Any

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .base import InferenceEndpoint

# Headers that describe one hop (RFC 9110 §7.6.1) or that the proxy sets itself.
_HOP = {
    "authorization",
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}


class Guard:
    """ASGI middleware: 401 without a right `Authorization: Bearer KEY`, 413 for bodies over the limit
    (declared Content-Length, and bytes counted as they stream in).

    Two keys: the admin key opens every route; the inference key (rollout workers, Ray tasks) opens only the
    OpenAI-compatible `/v1/*` routes, so its holder can sample but never register, train or delete."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, inference_key: str | None = None
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.inference_key = inference_key.encode() if inference_key else None
        self.max_body_bytes = max_body_bytes

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
        role = self.role(scope)
        if role is None:
            await _send_json(
                send, 401, {"detail": "bad or missing API key"}, [(b"www-authenticate", b"Bearer")]
            )
            return
        if role == "inference" and not str(scope.get("path", "")).startswith("/v1/"):
            await _send_json(send, 403, {"detail": "the inference key only opens /v1/* (inference) routes"})
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _send_json(send, 413, {"detail": f"request body over the {self.max_body_bytes}-byte limit"})
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, f"request body over the {self.max_body_bytes}-byte limit")
            return message

        await self.app(scope, counted, send)


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


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


# The inference server's routes a client may reach through the proxy; everything else (vLLM's LoRA loading,
# sleep, collective_rpc, cache resets, `..` tricks) is refused before any upstream call.
ALLOWED_PATHS = frozenset({"chat/completions", "completions", "responses", "messages", "models"})


class InferenceProxy:
    """Forwards `/v1/{chat/completions, completions, responses, messages, models}` to the upstream endpoint of the
    model a request names, when that model is one this server registered (one shared pooled client)."""

    def __init__(self, *, read_timeout_s: float = 600.0, max_connections: int = 2048) -> None:
        self._routes: dict[str, InferenceEndpoint] = {}
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    # ---- routing table ---------------------------------------------------------------------------------------

    def add(self, names: list[str], endpoint: InferenceEndpoint) -> None:
        for name in names:
            if name:
                self._routes[name] = endpoint

    def upstream(self, model: str | None) -> InferenceEndpoint | None:
        """The endpoint serving `model` (`name` or `name@step`), if it is a model this server registered."""
        if model:
            for key in (model, model.split("@", 1)[0]):
                if key in self._routes:
                    return self._routes[key]
        return None

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

    async def list_models(self) -> Response:
        """`GET /v1/models`: the union of what every upstream serves."""
        data: list[dict[str, Any]] = []
        seen: set[str] = set()
        for endpoint in {(e.base_url, e.api_key): e for e in self._routes.values()}.values():
            try:
                response = await self.client.get(_join(endpoint.base_url, "models"), headers=_auth(endpoint))
                response.raise_for_status()
                items = response.json().get("data") or []
            except (httpx.HTTPError, ValueError) as error:
                return openai_error(
                    502, f"inference server {endpoint.base_url} failed: {error}", "upstream_error"
                )
            for item in items:
                name = str(item.get("id"))
                if name not in self._routes and name.split("@", 1)[0] not in self._routes:
                    continue  # the base model and others' adapters are not this server's to offer
                if item.get("id") not in seen:
                    seen.add(item.get("id"))
                    data.append(item)
        return JSONResponse({"object": "list", "data": data})

    async def forward(self, request: Request, path: str) -> Response:
        if path not in ALLOWED_PATHS or request.method != "POST" and path != "models":
            return openai_error(404, f"/v1/{path} is not served here (inference routes only)", "not_found")
        body = await request.body()
        model: str | None = None
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                return openai_error(400, "request body is not valid JSON")
            model = payload.get("model") if isinstance(payload, dict) else None
        endpoint = self.upstream(model)
        if endpoint is None:
            known = ", ".join(sorted(self._routes)) or "none"
            return openai_error(
                404, f"model {model!r} is not registered on this server (registered: {known})"
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update(_auth(endpoint))
        upstream = self.client.build_request(
            request.method,
            _join(endpoint.base_url, path),
            params=request.query_params,
            headers=headers,
            content=body,
        )
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            return openai_error(
                502, f"inference server {endpoint.base_url} unreachable: {error!r}", "upstream_error"
            )
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP}
        if "content-length" in response.headers:  # raw bytes pass through, so the upstream length holds
            out_headers["content-length"] = response.headers["content-length"]
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers=out_headers,
            background=BackgroundTask(response.aclose),
        )


def _auth(endpoint: InferenceEndpoint) -> dict[str, str]:
    return {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _join(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + "/" + path.lstrip("/")
