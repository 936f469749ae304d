"""`serve` from an attacker's side, part two: the key handed to rollouts, a keyless server reached by a web page
(DNS rebinding), the headers a client may pass to the engine, and step numbers in other scripts' digits. Real
uvicorn servers on 127.0.0.1; the upstream records what reached it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_adapters.backend.server import create_app
from test_remote_backend import FakeBackend, running, trainable

ADMIN = "admin-key-1"
CHAT = {"model": "agent-1", "messages": [{"role": "user", "content": "hi"}]}


class Upstream:
    """An OpenAI-compatible upstream that answers every chat and keeps the headers each request carried."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    def app(self) -> Starlette:
        async def chat(request: Request) -> JSONResponse:
            self.headers.append(dict(request.headers))
            message = {"role": "assistant", "content": "ok"}
            return JSONResponse({"id": "c", "object": "chat.completion", "choices": [{"message": message}]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    recorder = Upstream()
    with running(recorder.app()) as url:
        yield recorder, f"{url}/v1"


def serving(tmp_path: Path, upstream_url: str, **settings: Any) -> Any:
    fake = FakeBackend(tmp_path / "art", upstream_url)
    return running(create_app(fake, allowed_base_models=["tiny"], **settings))


def registered(url: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": trainable().model_dump(mode="json")}
    return httpx.post(f"{url}/models/register", json=body, headers=headers, timeout=30)


def test_serve_never_hands_out_its_admin_key(tmp_path: Path, upstream: tuple[Upstream, str]) -> None:
    """Without `--inference-key`, registration handed the admin key to rollouts, Ray workers and recording
    endpoints: whoever held a rollout's key could train and delete. A separate inference key is minted."""
    with serving(tmp_path, upstream[1], api_key=ADMIN) as url:
        answer = registered(url, ADMIN)
        handed = answer.json()["api_key"]
        assert answer.status_code == 200 and handed not in (ADMIN, "none") and len(handed) >= 32
        worker = {"authorization": f"Bearer {handed}"}
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=worker).status_code == 200
        body = {"model": trainable().model_dump(mode="json")}
        refused = httpx.post(f"{url}/models/delete_checkpoints", json=body, headers=worker)
        assert refused.status_code == 403
        assert registered(url, ADMIN).json()["api_key"] == handed  # one key for the server's lifetime
    with pytest.raises(ValueError, match="must differ"):
        create_app(FakeBackend(tmp_path, upstream[1]), api_key=ADMIN, inference_key=ADMIN)


@pytest.mark.parametrize(
    "headers",
    [
        {"host": "attacker.example:7999"},  # the page's own name, rebound to 127.0.0.1
        {"host": "127.0.0.1.nip.io"},
        {"origin": "http://attacker.example"},  # a cross-site request from a page
        {"origin": "null"},
    ],
)
def test_a_keyless_server_answers_only_its_own_loopback_names(
    tmp_path: Path, upstream: tuple[Upstream, str], headers: dict[str, str]
) -> None:
    """A keyless `serve` on loopback took any Host: a web page that rebinds its name to 127.0.0.1 could train,
    delete and sample."""
    fake = FakeBackend(tmp_path / "art", upstream[1])
    with running(create_app(fake, api_key=None, allowed_base_models=["tiny"])) as url:
        body = {"model": trainable().model_dump(mode="json")}
        for path, payload in (("/models/register", body), ("/v1/chat/completions", CHAT)):
            refused = httpx.post(f"{url}{path}", json=payload, headers=headers)
            assert refused.status_code == 403 and "not allowed" in refused.text, (path, refused.text)
        assert fake.calls == [] and upstream[0].headers == []
        port = url.rsplit(":", 1)[1]
        for own in ("127.0.0.1", f"localhost:{port}", f"[::1]:{port}", "127.9.9.9"):
            assert httpx.get(f"{url}/health", headers={"host": own}).status_code == 200, own
        local_page = {"origin": f"http://localhost:{port}"}
        assert registered(url, None).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=local_page).status_code == 200


def test_only_the_apis_headers_reach_the_engine(tmp_path: Path, upstream: tuple[Upstream, str]) -> None:
    """Client headers reached vLLM: `X-Request-Id` (collides with another client's request), `X-data-parallel-rank`
    (picks a replica), cookies; a non-ASCII header answered 500."""
    recorder, upstream_url = upstream
    with serving(tmp_path, upstream_url, api_key=ADMIN) as url:
        assert registered(url, ADMIN).status_code == 200
        sent = {
            "authorization": f"Bearer {ADMIN}",
            "x-request-id": "someone-elses",
            "x-data-parallel-rank": "5",
            "cookie": "session=1",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "anthropic-version": "2023-06-01",
            "user-agent": "agent/1.0",
        }
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=sent).status_code == 200
        odd = [(b"authorization", f"Bearer {ADMIN}".encode()), (b"user-agent", "agént".encode("latin-1"))]
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=odd).status_code == 200
    first, second = recorder.headers
    assert first.get("anthropic-version") == "2023-06-01" and first.get("user-agent") == "agent/1.0"
    for header in ("x-request-id", "x-data-parallel-rank", "cookie", "traceparent"):
        assert header not in first, header
    assert "agént" not in str(second)


def test_a_step_in_other_digits_is_no_model(tmp_path: Path, upstream: tuple[Upstream, str]) -> None:
    """`model@²` passed `isdigit()` and answered 500."""
    with serving(tmp_path, upstream[1], api_key=ADMIN) as url:
        assert registered(url, ADMIN).status_code == 200
        auth = {"authorization": f"Bearer {ADMIN}"}
        for model in ("agent-1@²", "agent-1@٣", "agent-1@" + "9" * 5000, "agent-1@-1"):
            refused = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": model}, headers=auth)
            assert refused.status_code == 404 and "no such step" in refused.text, model
    assert upstream[0].headers == []
