"""A steering proxy in front of vLLM for the framework matrix: a random tiny model will not call tools by itself, so
each request gets a structured-output `choice` + logit bias (`testing.steer`) for the text its framework's script
says comes next; the engine still samples every token. The capture, upstream of this proxy, sees only the model.

Every exchange is logged with the token ids and logprobs parsed here, independently of the capture, so the test can
check that each captured call holds exactly what vLLM returned, and with the model vLLM served it by (per-agent
adapters: which agent's adapter it reached).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

Script = Callable[[dict[str, Any]], str]  # request body (chat or Responses) -> the text the model says next


@dataclass
class Exchange:
    framework: str
    api: str
    stream: bool
    said: str
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    request: dict[str, Any] = field(default_factory=dict)
    served: str = ""  # the model vLLM says it served (its answer's `model`: a LoRA's name, as it received it)


class SteeringProxy:
    """Serves `/{framework}/v1/*` on 127.0.0.1 and forwards to vLLM's `/v1/*`, steered by `scripts[framework]`."""

    def __init__(
        self, upstream: str, api_key: str | None, tokenizer: Any, scripts: dict[str, Script]
    ) -> None:
        self.upstream, self.api_key, self.tokenizer, self.scripts = (
            upstream.rstrip("/"),
            api_key,
            tokenizer,
            scripts,
        )
        self.exchanges: list[Exchange] = []
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def base_url(self, framework: str) -> str:
        return f"http://127.0.0.1:{self.port}/{framework}/v1"

    async def _forward(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        from art_adapters.testing import steer

        framework, path = request.path_params["framework"], request.path_params["path"]
        body = await request.body()
        api = {"chat/completions": "chat", "responses": "responses"}.get(path)
        headers = {"authorization": f"Bearer {self.api_key}", "content-type": "application/json"}
        if api is None or request.method != "POST":  # /models and the like pass through
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.request(request.method, f"{self.upstream}/{path}", headers=headers)
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        payload = json.loads(body)
        try:
            said = self.scripts[framework](payload)
        except Exception as error:  # a script that cannot tell what comes next is a test bug: say which
            return JSONResponse({"error": {"message": f"steering script {framework}: {error!r}"}}, 500)
        steered = {**payload, **steer(self.tokenizer, said)}
        if (
            payload.get("tool_choice") == "required"
        ):  # vLLM's grammar for it would override the script's, which
            steered["tool_choice"] = "auto"  # calls a tool anyway
        if payload.get(
            "tools"
        ):  # vLLM's grammar for strict tools would fight the script; the capture keeps them
            steered["tools"] = [_lenient(tool) for tool in payload["tools"]]
        exchange = Exchange(framework, api, bool(payload.get("stream")), said)
        exchange.request = {k: v for k, v in payload.items() if k not in ("messages", "tools", "input")}
        client = httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30))
        upstream = await client.send(
            client.build_request("POST", f"{self.upstream}/{path}", json=steered, headers=headers),
            stream=True,
        )

        async def chunks() -> Any:
            raw = b""
            try:
                async for chunk in upstream.aiter_bytes():
                    raw += chunk
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()
                if upstream.status_code == 200:
                    _parse(exchange, raw)
                    self.exchanges.append(exchange)

        media = upstream.headers.get("content-type", "application/json")
        versions = {
            k: v for k, v in upstream.headers.items() if k.lower().startswith("x-art-")
        }  # served_model
        return StreamingResponse(
            chunks(), status_code=upstream.status_code, media_type=media, headers=versions
        )

    def start(self) -> SteeringProxy:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/{framework}/v1/{path:path}", self._forward, methods=["GET", "POST"])])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)


def _lenient(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if isinstance(function, dict):
        return {**tool, "function": {**function, "strict": False}}
    return {**tool, "strict": False} if "strict" in tool else tool


def _parse(exchange: Exchange, raw: bytes) -> None:
    """vLLM's token ids and logprobs from a JSON body or an SSE stream, chat completions or Responses."""
    if exchange.stream:
        events = [
            json.loads(line[6:])
            for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    else:
        events = [json.loads(raw)]
    for event in events:
        exchange.served = exchange.served or str(event.get("response", event).get("model") or "")
        if exchange.api == "chat":
            exchange.prompt_token_ids += event.get("prompt_token_ids") or []
            for choice in event.get("choices") or []:
                exchange.completion_token_ids += choice.get("token_ids") or []
                content = (choice.get("logprobs") or {}).get("content") or []
                exchange.logprobs += [item["logprob"] for item in content]
        else:
            response = event.get("response", event) if exchange.stream else event
            if exchange.stream and event.get("type") != "response.completed":
                continue
            for message in response.get("input_messages") or []:
                exchange.prompt_token_ids += message.get("tokens") or []
            for message in response.get("output_messages") or []:
                exchange.completion_token_ids += message.get("tokens") or []
            for item in response.get("output") or []:  # logprobs come per output text, none for tool calls
                for part in item.get("content") or [] if item.get("type") == "message" else []:
                    exchange.logprobs += [entry["logprob"] for entry in part.get("logprobs") or []]
