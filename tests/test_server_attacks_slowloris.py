"""Slowloris against every server we run (`serve` in its own process, the inference gateway, the recording
endpoint, the OTLP endpoint): half-sent requests never timed out and connections were not capped (300 stayed open after 45 s; file
descriptors exhausted there starve checkpoint writes). With small limits set for the test, a connection over the
cap is answered 503, a head or body that stops arriving is closed, and the server keeps answering.

Run as a script it is the `serve` of the test: `python tests/test_server_attacks_slowloris.py PORT PATH`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.http_limits import ConnectionLimits
from art_adapters.inference.config import InferenceConfig
from art_adapters.inference.gateway import Gateway
from art_adapters.tracing.otlp_endpoint import OTLPEndpoint
from test_remote_backend import free_port

KEY = "slow-key"
LIMITS = ConnectionLimits(max_connections=4, header_timeout_s=1.0, body_timeout_s=1.0, max_head_bytes=4096)
GUARD_S = 15  # a hang guard, never a timing assertion
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"


def _serve_main(argv: list[str]) -> None:
    from art_adapters.backend.launch import serve
    from test_remote_backend import FakeBackend

    backend = FakeBackend(argv[1], "http://127.0.0.1:9/v1")
    serve("127.0.0.1", int(argv[0]), KEY, backend=backend, log_level="warning", connections=LIMITS)


def answer(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection (b"" when it closes without a word)."""
    sock.settimeout(GUARD_S)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def attack(port: int) -> None:
    with ExitStack() as stack:
        partial = []
        for _ in range(LIMITS.max_connections):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
            sock.sendall(HEAD)  # ... and never the blank line that ends it
            partial.append(sock)
        time.sleep(0.2)  # let the server take them in before the one too many
        extra = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        assert answer(extra).startswith(b"HTTP/1.1 503"), "a connection over the cap was served"
        for sock in partial:
            assert answer(sock).startswith(b"HTTP/1.1 408"), "a half-sent head was kept open"
        silent = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        assert answer(silent).startswith(b"HTTP/1.1 408"), "a connection that sent nothing was kept open"
        slow_body = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        slow_body.sendall(
            HEAD + b"content-length: 100\r\nauthorization: Bearer " + KEY.encode() + b"\r\n\r\n{"
        )
        assert b" 200 " not in answer(slow_body)  # closed without the rest of its body ever arriving
        assert trickled_bytes(stack.enter_context(socket.create_connection(("127.0.0.1", port)))) < 100
        huge = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        huge.sendall(HEAD + b"x-pad: " + b"a" * (2 * LIMITS.max_head_bytes))  # ... and more to come
        assert answer(huge).startswith(b"HTTP/1.1 431"), "an unbounded head was read"


def trickled_bytes(sock: socket.socket) -> int:
    """A body of 100 bytes sent one byte every 0.3 s (each read well within the body deadline): how many went out
    before the server closed the connection for its rate."""
    sock.sendall(HEAD + b"content-length: 100\r\nauthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    sock.settimeout(0.3)
    for sent in range(100):
        try:
            sock.sendall(b" ")
            if sock.recv(4096) == b"":
                return sent
        except TimeoutError:
            continue  # still open, nothing said
        except OSError:
            return sent
    return 100


def still_answers(url: str) -> None:
    assert httpx.get(url, headers={"authorization": f"Bearer {KEY}"}, timeout=GUARD_S).status_code < 500


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, str(port), str(tmp_path / "art")])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", headers={"authorization": f"Bearer {KEY}"}):
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(30)


def test_serve(serve_process: int) -> None:
    attack(serve_process)
    still_answers(f"http://127.0.0.1:{serve_process}/health")


def test_the_inference_gateway() -> None:
    engine = SimpleNamespace(died=False, running=True, config=InferenceConfig())  # never reached
    gateway = Gateway(engine)  # type: ignore[arg-type]
    gateway.connections = LIMITS
    gateway.start()
    try:
        attack(gateway.port)
        still_answers(f"http://127.0.0.1:{gateway.port}/health")
    finally:
        gateway.stop()


def test_the_recording_endpoint() -> None:
    with RecordingEndpoint("http://127.0.0.1:9/v1", limits=LIMITS) as endpoint:
        attack(endpoint.port)
        still_answers(f"{endpoint.base_url}/chat/completions")


def test_the_otlp_endpoint() -> None:
    """It was a plain uvicorn.Config: a half-sent head held its connection open for good."""
    with OTLPEndpoint(api_key=KEY, limits=LIMITS) as endpoint:
        attack(endpoint.port)
        still_answers(endpoint.url)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _serve_main(sys.argv[1:])
