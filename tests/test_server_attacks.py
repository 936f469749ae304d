"""The server from an attacker's side: a client WITH a valid key tries to run code, reach vLLM's management routes
or another's model, and gets a clear refusal, while the backend and the upstream show that nothing happened."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from test_remote_backend import FakeBackend, running, trainable

ADMIN, INFERENCE = "admin-key-1", "inference-key-2"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def upstream() -> Iterator[ScriptedServer]:
    with ScriptedServer(None) as server:
        yield server


@pytest.fixture
def fake(tmp_path: Path, upstream: ScriptedServer) -> FakeBackend:
    return FakeBackend(tmp_path / "art", upstream.base_url)


@pytest.fixture
def served(fake: FakeBackend) -> Iterator[str]:
    app = create_app(fake, api_key=ADMIN, inference_key=INFERENCE, allowed_base_models=["tiny"])
    with running(app) as url:
        yield url


def as_user(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30)


def register(client: httpx.Client, **fields: Any) -> httpx.Response:
    model = {**trainable().model_dump(mode="json"), **fields}
    return client.post("/models/register", json={"model": model})


def test_registration_cannot_choose_engine_flags_environment_or_base_model(
    served: str, fake: FakeBackend, tmp_path: Path
) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "config.json").write_text("{}")
    (planted / "sitecustomize.py").write_text("open('/tmp/pwned', 'w')")
    with as_user(served, ADMIN) as admin:
        flags = register(
            admin, inference={"extra_args": ["--trust-remote-code"], "extra_env": {"PYTHONPATH": "/x"}}
        )
        assert flags.status_code == 422 and "cannot be chosen by a model" in flags.text
        tuned = register(admin, inference={"max_model_len": 64})
        assert tuned.status_code == 403 and "the server's to choose" in tuned.text
        for base in (str(planted), "evil-org/evil-model", "../../etc"):
            refused = register(admin, base_model=base)
            assert refused.status_code == 403 and "not allowed on this server" in refused.text, base
    assert [c for c in fake.calls if c[0] == "register"] == []  # the backend never saw any of them
    assert not Path("/tmp/pwned").exists()


def test_the_inference_key_samples_but_cannot_register_train_or_delete(
    served: str, fake: FakeBackend, upstream: ScriptedServer
) -> None:
    with as_user(served, ADMIN) as admin:
        answer = register(admin)
        assert (
            answer.status_code == 200 and answer.json()["api_key"] == INFERENCE
        )  # handed to rollout workers
    model = trainable().model_dump(mode="json")
    with as_user(served, INFERENCE) as worker:
        for path in (
            "/models/register",
            "/models/train",
            "/models/delete_checkpoints",
            "/models/log",
            "/health",
        ):
            refused = worker.post(path, json={"model": model, "groups": []})
            assert refused.status_code == 403 and "only opens /v1/*" in refused.text, path
        ok = worker.post("/v1/chat/completions", json={"model": "agent-1", **CHAT})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "echo: hi"
        anthropic_style = worker.post("/v1/messages", json={"model": "agent-1", "max_tokens": 8, **CHAT})
        assert (
            anthropic_style.status_code == 200 and anthropic_style.json()["content"][0]["text"] == "echo: hi"
        )
    assert [c[0] for c in fake.calls] == ["register"]
    assert len(upstream.requests) == 2


@pytest.mark.parametrize(
    "path",
    [
        "load_lora_adapter",
        "unload_lora_adapter",
        "sleep",
        "wake_up",
        "collective_rpc",
        "reset_prefix_cache",
        "../reset_prefix_cache",
        "chat/completions/../../load_lora_adapter",
        "%2e%2e/collective_rpc",
        "embeddings",
        "",
    ],
)
def test_the_proxy_forwards_only_inference_routes(served: str, upstream: ScriptedServer, path: str) -> None:
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
        refused = admin.post(f"/v1/{path}", json={"model": "agent-1", "lora_name": "x", "lora_path": "/tmp"})
    assert refused.status_code == 404, (path, refused.status_code, refused.text)
    assert upstream.requests == []  # refused before any upstream call


def test_a_model_the_server_did_not_register_is_refused(served: str, upstream: ScriptedServer) -> None:
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
        for name in ("scripted-model", "someone-else", None):  # the base model, another name, none at all
            body = {**CHAT, **({"model": name} if name else {})}
            refused = admin.post("/v1/chat/completions", json=body)
            assert refused.status_code == 404 and "not registered on this server" in refused.text
        assert admin.get("/v1/models").json()["data"] == []  # the upstream's base model is not offered
    assert upstream.requests == []


async def test_remote_backend_refuses_engine_settings_before_sending(served: str, fake: FakeBackend) -> None:
    model = art.TrainableModel(
        name="agent-1",
        project="proj",
        base_model="tiny",
        _internal_config=art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(max_model_len=99)),
    )
    with pytest.raises(art.RemoteBackendError, match="the server's"):
        await model.register(art.RemoteBackend(served, api_key=ADMIN))
    assert fake.calls == []


def test_base_models_already_on_disk_are_allowed_by_default(tmp_path: Path, upstream: ScriptedServer) -> None:
    fake = FakeBackend(tmp_path / "art", upstream.base_url)
    record = tmp_path / "art" / "proj" / "models" / "old" / "model.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"name": "old", "project": "proj", "base_model": "disk-model"}))
    with running(create_app(fake, api_key=ADMIN)) as url, as_user(url, ADMIN) as admin:
        assert register(admin, base_model="disk-model").status_code == 200
        assert register(admin, base_model="tiny").status_code == 403  # not on disk, not allowed at start
