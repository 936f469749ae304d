"""The gateway's version table against an engine whose adapter loads take time: a load never pauses requests for
other versions, an old version asked for by name is loaded once and kept while used (least recently used out
beyond the engine's room, the rest after their grace), and every request's in-flight count ends however the
request ends. The engine is a scripted OpenAI server behind a fake adapter registry (no vLLM needed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from art_adapters.inference.gateway import Gateway
from art_adapters.testing import ScriptedServer


class SlowEngine:
    """What the gateway uses of a VLLMServer: an OpenAI server (scripted) and adapters that take `load_s` to load."""

    def __init__(self, server: ScriptedServer, load_s: float = 0.0, max_loras: int = 4) -> None:
        self.base_url = server.base_url
        self.api_key = "engine-key"
        self.config = SimpleNamespace(max_model_len=4096, max_loras=max_loras, replicas=1)
        self.loras: dict[str, Path] = {}
        self.load_s = load_s
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.died = False
        self.running = True
        self.process = None
        self.log_path = None

    async def load_lora(self, name: str, path: Path) -> float:
        await asyncio.sleep(self.load_s)
        self.loras[name] = Path(path)
        self.loaded.append(name)
        return self.load_s

    async def unload_lora(self, name: str) -> None:
        self.loras.pop(name, None)
        self.unloaded.append(name)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SlowEngine]:
    with ScriptedServer(lambda request: "ok", cycle=True) as server:
        yield SlowEngine(server)


@pytest.fixture
def gateway(engine: SlowEngine) -> Iterator[Gateway]:
    gw = Gateway(engine).start()  # type: ignore[arg-type]
    yield gw
    gw.stop()


async def ask(
    gateway: Gateway, model: str, client: httpx.AsyncClient | None = None
) -> tuple[httpx.Response, float]:
    began = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        response = await client.post(
            f"{gateway.base_url}/chat/completions",
            headers={"authorization": f"Bearer {gateway.api_key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    return response, time.perf_counter() - began


async def test_a_slow_load_never_pauses_requests_for_other_versions(
    gateway: Gateway, engine: SlowEngine, tmp_path: Path
) -> None:
    """Timed on one kept-alive connection, the fastest of a few requests each way (a loaded machine delays any one
    request; a request that waited on a load would take the rest of that load, about a second)."""
    await gateway.publish("p/a", "a", 0, tmp_path / "a0")
    async with httpx.AsyncClient(timeout=30) as client:
        baseline = min([(await ask(gateway, "p/a", client))[1] for _ in range(5)])
        engine.load_s = 1.0
        loading = asyncio.create_task(gateway.publish("p/b", "b", 0, tmp_path / "b0"))  # another model's step
        stepping = asyncio.create_task(
            gateway.publish("p/a", "a", 1, tmp_path / "a1")
        )  # this model's next step
        await asyncio.sleep(0.1)  # both loads under way
        during = []
        for _ in range(3):
            response, seconds = await ask(gateway, "p/a", client)
            assert response.status_code == 200 and response.headers["x-art-served-model"] == "p/a@0"
            during.append(seconds)
        assert not loading.done() and not stepping.done()  # answered while both loads were still running
        assert min(during) - baseline < 0.1, (during, baseline)
        await asyncio.gather(loading, stepping)
        response, _ = await ask(gateway, "p/a", client)
    assert response.headers["x-art-served-model"] == "p/a@1"


async def test_an_old_version_asked_for_by_name_is_loaded_once_and_kept_while_used(
    gateway: Gateway, engine: SlowEngine, tmp_path: Path
) -> None:
    for step in range(3):
        await gateway.publish("p/a", "a", step, tmp_path / f"a{step}")
    # within the engine's room (4), kept for their grace
    assert set(engine.loras) == {"p/a@0", "p/a@1", "p/a@2"}
    gateway.keep_old_s = 0.3
    for _ in range(100):  # the watchdog's sweep (every 0.5 s) retires them
        if set(engine.loras) == {"p/a@2"}:
            break
        await asyncio.sleep(0.1)
    assert set(engine.loras) == {"p/a@2"}
    gateway.keep_old_s = 60.0
    loads = len(engine.loaded)
    for _ in range(5):
        response, _ = await ask(gateway, "p/a@0")
        assert response.status_code == 200 and response.headers["x-art-policy-version"] == "0"
    assert len(engine.loaded) - loads == 1  # five requests, one load

    for step in range(3, 7):  # more versions than the engine's room: least recently used out first
        await gateway.publish("p/a", "a", step, tmp_path / f"a{step}")
        await ask(gateway, f"p/a@{step - 1}")
    assert len(engine.loras) <= 4 and "p/a@6" in engine.loras and "p/a@0" not in engine.loras


async def test_names_with_non_ascii_digits_are_not_served(gateway: Gateway, tmp_path: Path) -> None:
    await gateway.publish("p/a", "a", 2, tmp_path / "a2")
    for name in ("p/a@²", "p/a@٢", "p/a@-2", "p/a@ 2", "p/a@9999999999999"):
        response, _ = await ask(gateway, name)
        assert response.status_code == 404 and "no such step" in response.text, name


async def test_every_request_ends_its_in_flight_count(
    gateway: Gateway, engine: SlowEngine, tmp_path: Path
) -> None:
    await gateway.publish("p/a", "a", 0, tmp_path / "a0")
    await gateway.publish("p/a", "a", 1, tmp_path / "a1")
    async with httpx.AsyncClient(timeout=30) as client:
        odd = await client.post(  # a header value no upstream request can carry as text
            f"{gateway.base_url}/chat/completions",
            headers=[
                (b"authorization", f"Bearer {gateway.api_key}".encode()),
                (b"x-note", "caf\u00e9 \u2603".encode()),
            ],
            json={"model": "p/a@0", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert odd.status_code in (200, 400)  # the header is not forwarded, or refused: never a 500
    version = gateway.models["p/a"].versions[0]
    for _ in range(50):  # the count ends once the answer's last byte is sent, which the client may see first
        if version.in_flight == 0 and gateway.in_flight == 0:
            break
        await asyncio.sleep(0.1)
    assert version.in_flight == 0 and gateway.in_flight == 0
    busy = gateway.busy_seconds()
    await asyncio.sleep(0.2)
    assert gateway.busy_seconds() == busy  # nothing counted as running


async def test_each_models_step_0_stays_loaded_when_more_models_than_the_engines_room_register() -> None:
    """A newly registered model's step 0 is its newest version: never made room for, however full the engine is
    (found by the per-agent matrix: `newest or -1` took step 0 for no version, so each new model's step 0 was
    unloaded as soon as the next adapter loaded)."""
    from art_adapters.inference.versions import VersionTable

    engine: set[str] = set()

    async def load(version: object) -> None:
        engine.add(version.adapter)  # type: ignore[attr-defined]

    async def unload(version: object) -> None:
        engine.discard(version.adapter)  # type: ignore[attr-defined]

    table = VersionTable(load, unload, lambda: 2, keep_old_s=60)
    for model in ("p/a", "p/b", "p/c"):
        await table.publish(model, model[2:], 0, Path(f"/x/{model}"))
    await table.publish("p/a", "a", 1, Path("/x/a1"))
    assert engine == {"p/a@1", "p/b@0", "p/c@0"}  # every model's newest, past the room of 2; a@0 made room
