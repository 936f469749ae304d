"""A caller with a valid key sends a registration whose `PerAgent` holds huge values: the server's 422 names the
field and the reason, never the input echoed back (the server's promise: it may be huge). The real server app
(uvicorn on 127.0.0.1) over a FakeBackend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from test_remote_backend import FakeBackend, running

KEY = "server-key"
HUGE = "x" * 1_000_000


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with ScriptedServer(None) as scripted:
        fake = FakeBackend(tmp_path / "art", scripted.base_url)
        with running(create_app(fake, api_key=KEY, allowed_base_models=["tiny"])) as served:
            yield served


@pytest.mark.parametrize(
    "adapters", [{"by": HUGE}, {"agents": [HUGE, HUGE]}], ids=["huge-by", "huge-duplicate-agents"]
)
def test_a_registration_with_huge_per_agent_values_is_a_short_422(url: str, adapters: dict) -> None:
    body = {"model": {"name": "m", "project": "p", "base_model": "tiny", "adapters": adapters}}
    answer = httpx.post(
        f"{url}/models/register", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert answer.status_code == 422
    assert len(answer.content) < 4096, f"{len(answer.content)} bytes: the input echoed back"
    assert "adapters" in answer.json()["detail"][0]["loc"]


def test_the_messages_still_name_a_short_value() -> None:
    with pytest.raises(ValueError, match=r"not 'planer'"):
        art.PerAgent(by="planer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'a' and 'a' name the same adapter"):
        art.PerAgent(agents=["a", "a"])


def test_a_misspelt_per_agent_setting_is_refused_not_ignored(url: str) -> None:
    with pytest.raises(ValueError, match="agnets"):
        art.PerAgent(agnets=["planner", "executor"])  # type: ignore[call-arg]
    body = {"model": {"name": "m", "project": "p", "base_model": "tiny", "adapters": {"agnets": ["a"]}}}
    answer = httpx.post(
        f"{url}/models/register", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert answer.status_code == 422
    assert any("agnets" in e["loc"] for e in answer.json()["detail"])
