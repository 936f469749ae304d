"""ScriptedServer: a real OpenAI-compatible HTTP server on 127.0.0.1 answering from a script, for tests and demos.

Runs uvicorn (httptools/h11) with a minimal ASGI app in a background thread when uvicorn is importable, else the
stdlib ThreadingHTTPServer; both serve the same rendered bytes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .anthropic import render_anthropic
from .replies import Rendered, Reply, error_body, render_chat, render_completion
from .responses import render_response

Responder = Callable[[dict[str, Any]], "Reply | str"]


def _echo(request: dict[str, Any]) -> Reply:
    users = [m for m in request.get("messages") or [] if m.get("role") == "user"]
    content = users[-1].get("content") if users else request.get("prompt", "")
    return Reply(content=f"echo: {content}")


ROUTES = ("/chat/completions", "/completions", "/responses", "/v1/messages")


class ScriptedServer:
    """An OpenAI-compatible server whose answers come from a script.

    >>> with ScriptedServer([Reply(content="hi"), Reply(tool_calls=[{"name": "f", "arguments": {"x": 1}}])]) as srv:
    ...     client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    ...     client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hey"}])
    ...     srv.requests[-1]["messages"]

    `script`: a list of Reply (or str) consumed in order (`cycle=True` repeats it), one Reply, or a
    `responder(request_json) -> Reply | str` callable (thread-safe, request-dependent answers). None echoes the
    last user message. A spent script answers HTTP 500. `.requests` holds every POSTed JSON body in arrival order.
    With `return_token_ids` the answer carries vLLM's `prompt_token_ids` / `choices[i].token_ids` (the utf-8 bytes of
    a canonical rendering; see `replies.prompt_text`), with `logprobs` deterministic negative logprobs.
    `/v1/responses` (JSON and streamed events) answers the same script as the Responses API, with vLLM's
    `input_messages` / `output_messages` token extras when asked (`testing/responses.py`); `/v1/messages` answers
    it as Anthropic's Messages API, as vLLM serves it (`testing/anthropic.py`).
    """

    def __init__(
        self,
        script: Iterable[Reply | str] | Reply | Responder | None = None,
        *,
        cycle: bool = False,
        model: str = "scripted-model",
        engine: str = "auto",
    ) -> None:
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._cycle = cycle
        self._responder: Responder | None = None
        self._script: list[Reply] = []
        if script is None:
            self._responder = _echo
        elif callable(script) and not isinstance(script, Reply):
            self._responder = script
        else:
            items = [script] if isinstance(script, Reply) else list(script)  # type: ignore[arg-type]
            self._script = [Reply(content=r) if isinstance(r, str) else r for r in items]
        self._position = 0
        self.engine = _pick_engine(engine)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopper: Callable[[], None] | None = None
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        self._sock, self.port = sock, sock.getsockname()[1]
        ready = threading.Event()
        if self.engine == "uvicorn":
            self._start_uvicorn(sock, ready)
        else:
            self._start_stdlib(sock, ready)
        if not ready.wait(30):
            raise RuntimeError("ScriptedServer did not start within 30 s")
        return self

    def stop(self) -> None:
        if self._stopper is not None:
            self._stopper()
        if self._thread is not None:
            self._thread.join(10)
        if self._sock is not None:
            self._sock.close()
        self._thread = self._stopper = self._sock = None

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_uvicorn(self, sock: socket.socket, ready: threading.Event) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.asgi,
            interface="asgi3",
            log_level="critical",
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            timeout_keep_alive=30,
            backlog=2048,
        )
        server = uvicorn.Server(config)

        def run() -> None:
            asyncio.run(server.serve(sockets=[sock]))

        def wait_started() -> None:
            deadline = time.monotonic() + 30
            while (
                not server.started
                and time.monotonic() < deadline
                and self._thread
                and self._thread.is_alive()
            ):
                time.sleep(0.002)
            ready.set()

        def stop() -> None:
            server.should_exit = True

        self._stopper = stop
        self._thread = threading.Thread(target=run, name=f"scripted-server-{self.port}", daemon=True)
        self._thread.start()
        wait_started()
        if not server.started:
            raise RuntimeError("ScriptedServer (uvicorn) did not start")

    def _start_stdlib(self, sock: socket.socket, ready: threading.Event) -> None:
        owner = self

        class Handler(_StdlibHandler):
            server_owner = owner

        httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler, bind_and_activate=False)
        httpd.socket.close()
        httpd.socket = sock
        httpd.daemon_threads = True
        self._stopper = httpd.shutdown
        self._thread = threading.Thread(
            target=httpd.serve_forever, name=f"scripted-server-{self.port}", daemon=True
        )
        self._thread.start()
        ready.set()

    # ---- script --------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def next_reply(self, request: dict[str, Any]) -> Reply | None:
        if self._responder is not None:
            answer = self._responder(request)
            return Reply(content=answer) if isinstance(answer, str) else answer
        with self._lock:
            if self._position >= len(self._script):
                if not self._cycle or not self._script:
                    return None
                self._position = 0
            reply = self._script[self._position]
            self._position += 1
            return reply

    def handle(self, method: str, path: str, body: bytes) -> Rendered:
        """Answer one HTTP request (engine-independent)."""
        path = path.split("?", 1)[0].rstrip("/")
        if method == "GET" and path.endswith("/models"):
            data = [{"id": self.model, "object": "model", "created": 0, "owned_by": "scripted"}]
            return Rendered(body=json.dumps({"object": "list", "data": data}).encode())
        if method != "POST" or not path.endswith(ROUTES):
            return Rendered(status=404, body=error_body(404, f"no route {method} {path}"))
        try:
            request = json.loads(body)
        except ValueError:
            return Rendered(status=400, body=error_body(400, "request body is not JSON"))
        with self._lock:
            self.requests.append(request)
            self._seq += 1
            seq = self._seq
        try:
            reply = self.next_reply(request)
        except Exception as error:  # a responder bug must show up in the test, not hang it
            return Rendered(status=500, body=error_body(500, f"responder raised {error!r}"))
        if reply is None:
            return Rendered(status=500, body=error_body(500, "script exhausted"))
        if path.endswith("/responses"):
            return render_response(request, reply, seq=seq, model=self.model)
        if path.endswith("/v1/messages"):
            return render_anthropic(request, reply, seq=seq, model=self.model)
        render = render_chat if path.endswith("/chat/completions") else render_completion
        return render(request, reply, seq=seq, model=self.model)

    # ---- ASGI --------------------------------------------------------------------------------------------------

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        out = self.handle(scope["method"], scope["path"], b"".join(chunks))
        if out.delay_s:
            await asyncio.sleep(out.delay_s)
        headers = {"content-type": "application/json", **out.headers}
        if out.events is None:
            body = out.body or b""
            headers["content-length"] = str(len(body))
            await send({"type": "http.response.start", "status": out.status, "headers": _encode(headers)})
            await send({"type": "http.response.body", "body": body})
            return
        headers["cache-control"] = "no-cache"
        await send({"type": "http.response.start", "status": out.status, "headers": _encode(headers)})
        for k, event in enumerate(out.events):
            if out.cut_after is not None and k >= out.cut_after:
                raise _StreamCut  # uvicorn drops the connection mid-body: the client sees an incomplete read
            await send({"type": "http.response.body", "body": event, "more_body": True})
            if out.chunk_delay_s:
                await asyncio.sleep(out.chunk_delay_s)
        await send({"type": "http.response.body", "body": b""})


class _StreamCut(Exception):
    """Raised inside the ASGI app to cut a stream (uvicorn closes the connection)."""


def _encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in headers.items()]


def _pick_engine(engine: str) -> str:
    if engine not in {"auto", "uvicorn", "stdlib"}:
        raise ValueError(f"engine must be auto, uvicorn or stdlib, not {engine!r}")
    if engine != "auto":
        return engine
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        return "stdlib"
    return "uvicorn"


class _StdlibHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_owner: ScriptedServer

    def log_message(self, format: str, *args: Any) -> None:  # silence
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        out = self.server_owner.handle(self.command, self.path, body)
        if out.delay_s:
            time.sleep(out.delay_s)
        self.send_response(out.status)
        headers = {"content-type": "application/json", **out.headers}
        for key, value in headers.items():
            self.send_header(key, value)
        if out.events is None:
            payload = out.body or b""
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for k, event in enumerate(out.events):
            if out.cut_after is not None and k >= out.cut_after:
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()
            if out.chunk_delay_s:
                time.sleep(out.chunk_delay_s)
        self.wfile.write(b"0\r\n\r\n")

    do_GET = _serve
    do_POST = _serve
