"""The server's guard: no key beyond loopback, bearer key on every route, body limits, safe names, validated JSON."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_adapters.backend import launch
from art_adapters.backend.launch import check_bind
from art_adapters.backend.server import create_app
from art_adapters.untrusted import is_loopback
from test_remote_backend import FakeBackend, group, trainable

KEY = "s3cret-key"
MODEL = trainable().model_dump(mode="json")
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/health", None),
    ("POST", "/models/register", {"model": MODEL}),
    ("POST", "/models/step", {"model": MODEL}),
    ("POST", "/models/train", {"model": MODEL, "groups": [group([1.0]).model_dump(mode="json")]}),
    ("POST", "/models/train_sft", {"model": MODEL, "trajectories": []}),
    ("POST", "/models/log", {"model": MODEL, "groups": []}),
    ("POST", "/models/delete_checkpoints", {"model": MODEL}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "agent-1", "messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/v1/completions", {"model": "agent-1", "prompt": "x"}),
    ("GET", "/docs", None),
    ("GET", "/nowhere", None),
]


@pytest.fixture
def fake(tmp_path: Path) -> FakeBackend:
    return FakeBackend(tmp_path / "art", "http://127.0.0.1:9/v1")  # no upstream needed: nothing gets that far


@pytest.fixture
async def client(fake: FakeBackend) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(fake, api_key=KEY, max_body_bytes=64 * 1024, allowed_base_models=["tiny"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


# ---- binding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_key(host: str) -> None:
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "example.com", "localhost.evil"]
)
def test_beyond_loopback_without_key_refuses_to_start(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ART_ADAPTERS_API_KEY", raising=False)
    started: list[Any] = []
    monkeypatch.setattr("uvicorn.Server.run", lambda server, *a, **k: started.append(server))
    with pytest.raises(SystemExit, match="refusing to listen on .* without an API key.*--api-key"):
        launch.serve(host=host, port=1, backend=object())  # type: ignore[arg-type]
    assert started == []
    check_bind(host, KEY)  # with a key it may


def test_cli_refuses_and_env_key_allows(monkeypatch: pytest.MonkeyPatch, fake: FakeBackend) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ART_ADAPTERS_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "art_adapters.backend.launch", "--host", "0.0.0.0", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "refusing to listen on '0.0.0.0' without an API key" in done.stderr

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("uvicorn.Server.run", lambda server: calls.append(vars(server.config)))
    monkeypatch.setenv("ART_ADAPTERS_API_KEY", KEY)
    launch.serve(host="0.0.0.0", port=1234, backend=fake)
    assert calls and calls[0]["host"] == "0.0.0.0" and calls[0]["port"] == 1234


# ---- the key ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", KEY])
@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_every_route_needs_the_key(
    client: httpx.AsyncClient, fake: FakeBackend, auth: str | None, method: str, path: str, body: Any
) -> None:
    headers = {"authorization": auth} if auth else {}
    response = await client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json() == {"detail": "bad or missing API key"}
    assert fake.calls == []
    assert not fake.path.exists()  # nothing touched on disk


async def test_the_right_key_passes(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post(
        "/models/register", json={"model": MODEL}, headers={"authorization": f"bearer {KEY}"}
    )
    assert response.status_code == 200 and response.json()["api_key"] not in (
        KEY,
        "none",
    )  # never the admin key
    assert fake.calls == [("register", "agent-1")]


# ---- body size ----------------------------------------------------------------------------------------------


async def test_declared_oversize_body_is_413(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    big = b'{"model": "' + b"x" * 70_000 + b'"}'
    auth = {"authorization": f"Bearer {KEY}"}
    for path in ("/models/register", "/v1/chat/completions"):
        response = await client.post(path, content=big, headers=auth)
        assert response.status_code == 413, path
    response = await client.post("/models/step", content=b"{}", headers={**auth, "content-length": "nope"})
    assert response.status_code == 413
    assert fake.calls == []


async def test_streamed_oversize_body_is_413(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer
        yield b'{"model": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    for path in ("/models/register", "/models/train", "/v1/chat/completions"):
        response = await client.post(path, content=chunks(), headers={"authorization": f"Bearer {KEY}"})
        assert response.status_code == 413, path
    assert fake.calls == []


# ---- names and payloads -------------------------------------------------------------------------------------


def tree(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*"))


def outside_exists(root: Path) -> bool:
    return (root.parent / "x").exists() or Path("/abs").exists() or (root / "x").exists()


@pytest.mark.parametrize(
    "bad", ["../x", "/abs", "a/b", "..", ".", "a\\b", "", "x" * 65, "na me", "..%2f", "ü"]
)
@pytest.mark.parametrize("field", ["name", "project"])
async def test_unsafe_names_are_422_and_create_nothing(
    client: httpx.AsyncClient, fake: FakeBackend, tmp_path: Path, bad: str, field: str
) -> None:
    before = tree(tmp_path)
    model = {**MODEL, field: bad}
    auth = {"authorization": f"Bearer {KEY}"}
    for path, body in [
        ("/models/register", {"model": model}),
        ("/models/register", {"model": {"name": bad, "project": bad}}),  # a plain Model
        ("/models/step", {"model": model}),
        ("/models/train", {"model": model, "groups": []}),
        ("/models/delete_checkpoints", {"model": model}),
    ]:
        response = await client.post(path, json=body, headers=auth)
        assert response.status_code == 422, (path, response.text)
        # (a plain Model may be named "org/model", as in ART: then only its project is wrong)
        assert any(
            field in err["loc"] or {"name", "project"} & set(err["loc"]) for err in response.json()["detail"]
        )
    assert fake.calls == []
    assert tree(tmp_path) == before
    assert not outside_exists(tmp_path)


async def test_malformed_trajectories_are_422_naming_the_field(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    good = group([1.0]).model_dump(mode="json")
    cases = [
        ({**good, "trajectories": [{**good["trajectories"][0], "reward": "high"}]}, "reward"),
        (
            {**good, "trajectories": [{**good["trajectories"][0], "messages_and_choices": "hi"}]},
            "messages_and_choices",
        ),
        ({**good, "trajectories": "nope"}, "trajectories"),
        ({**good, "trajectories": [{**good["trajectories"][0], "metadata": {"k": [1, 2]}}]}, "metadata"),
    ]
    for bad_group, field in cases:
        response = await client.post(
            "/models/train", json={"model": MODEL, "groups": [bad_group]}, headers=auth
        )
        assert response.status_code == 422, response.text
        assert any(field in err["loc"] for err in response.json()["detail"]), (field, response.json())
    response = await client.post(
        "/models/train", json={"model": MODEL, "groups": [good], "config": {"loss": "x"}}, headers=auth
    )
    assert response.status_code == 422 and "loss" in response.json()["detail"][0]["loc"]
    response = await client.post("/models/train", content=b"\x80\x04pickle", headers=auth)  # JSON only
    assert response.status_code == 422
    response = await client.post("/v1/chat/completions", content=b"not json", headers=auth)
    assert response.status_code == 400
    assert fake.calls == []
