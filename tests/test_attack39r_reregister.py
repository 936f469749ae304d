"""Per-agent adapters over `serve` when a model registers again (a second rollout worker, a training script
restarted against a long-running server): the real server app (uvicorn on 127.0.0.1) over a real LocalBackend and
its real per-agent trainer on the tiny model, whose engine is a stand-in HTTP server that loads and serves adapters
(tests/test_routing_outside.py's). No vLLM."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.remote import RemoteBackend
from art_adapters.backend.server import create_app
from art_adapters.inference import InferenceConfig
from art_adapters.tiny import tiny_model_path
from test_remote_backend import running
from test_routing_outside import FakeServer, engine

KEY = "admin-key"


class FakeEngine(FakeServer):
    """The engine LocalBackend serves from (`use_server`): a real HTTP server that takes LoRA loads."""

    def __init__(self, url: str, base_model: str) -> None:
        super().__init__(url, [])
        self.base_model = base_model
        self.config = InferenceConfig(max_model_len=256, max_loras=8)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, art.LocalBackend, list[tuple[str, Any]]]]:
    events: list[tuple[str, Any]] = []
    base = str(tiny_model_path())
    with running(engine("engine", events)) as engine_url:
        backend = art.LocalBackend(tmp_path / "art").use_server(FakeEngine(engine_url, base))  # type: ignore[arg-type]
        with running(create_app(backend, api_key=KEY, allowed_base_models=[base])) as url:
            yield url, backend, events


def per_agent(adapters: art.PerAgent | None) -> art.TrainableModel:
    return art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()), adapters=adapters)


@pytest.mark.train
async def test_a_second_client_registering_the_model_is_told_the_agents_served(serve) -> None:
    url, _, _ = serve
    first = per_agent(art.PerAgent(by="role", agents=["a", "b"]))
    await first.register(RemoteBackend(url, api_key=KEY))
    assert first.agent_routing() is not None and first.agent_routing().served == {"a", "b"}
    # the script restarted (or a second worker) against the same server: a fresh instance registers again
    second = per_agent(art.PerAgent(by="role", agents=["a", "b"]))
    await second.register(RemoteBackend(url, api_key=KEY))
    routing = second.agent_routing()
    assert routing is not None and routing.served == {"a", "b"}, (
        "the agents' calls would go to the shared adapter"
    )
    assert routing.rewrite("p/m", art.CallSource(role="a")) == "p/m.a"


@pytest.mark.train
@pytest.mark.parametrize(
    "again",
    [None, art.PerAgent(by="agent", agents=["a", "b"]), art.PerAgent(by="role", agents=["a", "c"])],
    ids=["without", "other-by", "other-agents"],
)
async def test_registering_again_with_other_per_agent_settings_honours_them(
    serve, again: art.PerAgent | None, caplog: pytest.LogCaptureFixture
) -> None:
    url, backend, _ = serve
    first = per_agent(art.PerAgent(by="role", agents=["a", "b"]))
    await first.register(RemoteBackend(url, api_key=KEY))
    second = per_agent(again)
    with caplog.at_level(logging.WARNING, logger="art_adapters"):
        await second.register(RemoteBackend(url, api_key=KEY))
    (state,) = backend._models.values()
    trainer = await backend.trainer(state.model)
    # the new setting is the one the trainer trains by (not the first registration's, silently)
    assert state.model.adapters == again
    assert getattr(trainer, "per_agent", None) == again
    assert "registered again with adapters" in caplog.text
    if again is None:
        assert type(trainer).__name__ == "Trainer" and second.agent_routing() is None
        assert not any(
            key.startswith("p/m.") for key in state.gateway.models
        )  # the agents are served no more
    else:
        assert second.agent_routing() is not None


@pytest.mark.train
async def test_a_rollout_worker_that_never_trains_learns_of_new_agents_at_get_step(serve) -> None:
    """agents=None: an agent's adapter first appears after a step. The client that trained hears of it in the step's
    `done` event; a rollout worker (another process: it only samples) must hear of it too, or that agent's calls
    stay on the shared adapter there for good while its own adapter trains on them."""
    url, backend, _ = serve
    trainer_side = per_agent(art.PerAgent(by="role"))
    await trainer_side.register(RemoteBackend(url, api_key=KEY))
    worker = per_agent(art.PerAgent(by="role"))
    await worker.register(RemoteBackend(url, api_key=KEY))
    assert worker.agent_routing() is not None and worker.agent_routing().served == frozenset()
    # a step trained agent "a": the trainer holds its adapter and writes it under checkpoints/0001/agents/a
    (state,) = backend._models.values()
    trainer = await backend.trainer(state.model)
    trainer.add_adapter("a")  # type: ignore[union-attr]
    trainer.step = 1
    checkpoints.save_checkpoint(state.directory, 1, trainer.save)
    await backend.resume_from_disk(state.model)
    assert "p/m.a" in state.gateway.models  # served now
    assert await worker.get_step() == 1
    assert worker.agent_routing().served == {"a"}, (
        "the worker's agent 'a' calls still go to the shared adapter"
    )
    assert worker.agent_routing().rewrite("p/m", art.CallSource(role="a")) == "p/m.a"
