"""Per-agent adapters over RemoteBackend, without an engine: the real server (uvicorn on 127.0.0.1) over a
FakeBackend whose upstream is a ScriptedServer. What travels (JSON, never a function), how `/v1` reaches an agent's
adapter, and what a client holding a valid key cannot make the server do with names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import art_adapters as art
from art_adapters.agent_adapters import served_adapter
from art_adapters.backend.remote import RemoteBackend
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from test_remote_backend import FakeBackend, running

KEY = "server-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, FakeBackend, ScriptedServer]]:
    with ScriptedServer(None) as scripted:
        fake = FakeBackend(tmp_path / "art", scripted.base_url)
        with running(create_app(fake, api_key=KEY, allowed_base_models=["tiny"])) as url:
            yield url, fake, scripted


def per_agent_model(**settings: object) -> art.TrainableModel:
    return art.TrainableModel(name="m", project="p", base_model="tiny", adapters=art.PerAgent(**settings))


async def test_a_function_by_is_refused_before_anything_is_sent(served) -> None:
    url, fake, _ = served
    model = per_agent_model(by=lambda source: source.agent)
    with pytest.raises(art.UnsupportedPerAgentSetting, match=r"is a function.*cannot travel.*by='agent'"):
        await model.register(RemoteBackend(url, api_key=KEY))
    assert fake.calls == []  # nothing reached the server


async def test_the_setting_travels_and_v1_reaches_each_agents_adapter(served) -> None:
    url, fake, scripted = served
    model = per_agent_model(by="role", agents=["a", "b"])
    await model.register(RemoteBackend(url, api_key=KEY))
    on_server = art.TrainableModel.model_validate_json((fake.model_dir(model) / "model.json").read_text())
    assert on_server.adapters == art.PerAgent(by="role", agents=["a", "b"])
    headers = {"authorization": f"Bearer {model.inference_api_key}"}
    async with httpx.AsyncClient(base_url=f"{url}/v1", headers=headers, timeout=30) as http:
        for name in ("p/m.a", "p/m.b@3", "m.a"):
            answer = await http.post("/chat/completions", json={"model": name, **CHAT})
            assert answer.status_code == 200, answer.text
        refused = {
            name: await http.post("/chat/completions", json={"model": name, **CHAT})
            for name in ("p/m.../../x", "p/m.a/b", "p/m.shared x", "p/other.a", "p/m.a@²")
        }
    assert [r["model"] for r in scripted.requests] == ["m.a", "m.b@3", "m.a"]  # the engine's own names
    assert {name: r.status_code for name, r in refused.items()} == dict.fromkeys(refused, 404)
    assert "is not an adapter name" in refused["p/m.../../x"].json()["error"]["message"]


async def test_a_model_without_per_agent_adapters_has_no_agent_names(served) -> None:
    url, _, scripted = served
    model = art.TrainableModel(name="plain", project="p", base_model="tiny")
    await model.register(RemoteBackend(url, api_key=KEY))
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"{url}/v1/chat/completions",
            json={"model": "p/plain.a", **CHAT},
            headers={"authorization": f"Bearer {model.inference_api_key}"},
        )
    assert answer.status_code == 404 and scripted.requests == []


async def test_a_hand_written_registration_with_a_function_or_bad_by_is_a_422(served) -> None:
    url, fake, _ = served
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http:
        for by in ("<function f>", "../x", 3):
            body = {"model": {"name": "m", "project": "p", "base_model": "tiny", "adapters": {"by": by}}}
            answer = await http.post("/models/register", json=body)
            assert answer.status_code == 422, answer.text
            assert any(e["loc"][-1] == "by" or "by" in e["loc"] for e in answer.json()["detail"])
    assert fake.calls == []


def test_served_adapter_reads_the_adapter_and_version_of_a_call() -> None:
    assert served_adapter("p/m.planner@3") == ("planner", 3)
    assert served_adapter("p/m@2") == ("", 2)
    assert served_adapter("p/m.planner@3", "p/m") == ("planner", 3)
    assert served_adapter("p/m@3", "p/m") == ("", 3)
    assert served_adapter("p/other.x@3", "p/m") is None
    assert served_adapter(None) is None


async def test_more_listed_agents_than_the_servers_engine_holds_is_a_400_before_anything_starts(
    tmp_path: Path,
) -> None:
    from art_adapters.backend.remote import RemoteBackendError
    from art_adapters.inference import InferenceConfig
    from art_adapters.tiny import tiny_model_path

    base = str(tiny_model_path())
    backend = art.LocalBackend(tmp_path / "art", inference=InferenceConfig(max_loras=3))
    with running(create_app(backend, api_key=KEY, allowed_base_models=[base])) as url:
        model = art.TrainableModel(
            name="m", project="p", base_model=base, adapters=art.PerAgent(agents=["a", "b", "c"])
        )
        with pytest.raises(
            RemoteBackendError, match=r"lists 3 agents.*max_loras >= 5.*max_loras=3"
        ) as refused:
            await model.register(RemoteBackend(url, api_key=KEY))
    assert refused.value.status == 400
    assert backend._servers == {} and not any((tmp_path / "art").rglob("checkpoints"))  # no engine, no files
