"""Per-agent adapters on `art-adapters serve`: how many adapters the engine holds (`max_loras`) is the operator's
to choose, as every engine setting there is. Without a flag the default engine (max_loras 4) holds the shared
adapter and two agents: `PerAgent()` (agents=None) stops at the third agent with a 400 that said "raise max_loras"
(or the model's `inference=`, a 403 on a server): advice no one could follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn

import art_adapters as art
from art_adapters.backend import launch
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError
from art_adapters.backend.server import create_app
from art_adapters.inference import InferenceConfig
from art_adapters.tiny import tiny_model_path
from test_remote_backend import running


def test_serve_takes_max_loras_from_the_operator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[object] = []
    monkeypatch.setattr(launch, "create_app", lambda backend, **_: built.append(backend) or object())
    monkeypatch.setattr(launch, "uvicorn_config", lambda app, **_: None)
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    launch.serve_command(["--path", str(tmp_path), "--max-loras", "12"])
    (backend,) = built
    inference = backend.inference  # type: ignore[attr-defined]
    assert (
        inference.max_loras == 12 and "max_loras" in inference.model_fields_set
    )  # a client's list resizes nothing
    with pytest.raises(SystemExit, match="max-loras"):
        launch.serve(path=str(tmp_path), max_loras=0)


async def test_too_many_agents_over_serve_names_the_servers_flag(tmp_path: Path) -> None:
    base = str(tiny_model_path())
    backend = art.LocalBackend(tmp_path / "art", inference=InferenceConfig(max_loras=3))
    with running(create_app(backend, api_key="k", allowed_base_models=[base])) as url:
        model = art.TrainableModel(
            name="m", project="p", base_model=base, adapters=art.PerAgent(agents=["a", "b", "c"])
        )
        with pytest.raises(RemoteBackendError, match=r"art-adapters serve --max-loras") as refused:
            await model.register(RemoteBackend(url, api_key="k"))
    assert refused.value.status == 400


async def test_a_callers_agent_list_alone_never_sizes_the_engine_past_the_cap(tmp_path: Path) -> None:
    """A caller with a valid key listing thousands of agents would size the engine (2 x (N + 1) LoRA slots) and the
    trainer (N optimizers) as it liked: past the cap it is a 400 naming the operator's flag, before anything starts."""
    from art_adapters.backend.serving import MAX_AUTO_SIZED_AGENTS, sized_for_agents

    base = str(tiny_model_path())
    many = [f"a{i}" for i in range(MAX_AUTO_SIZED_AGENTS + 1)]
    backend = art.LocalBackend(tmp_path / "art")
    with running(create_app(backend, api_key="k", allowed_base_models=[base])) as url:
        model = art.TrainableModel(name="m", project="p", base_model=base, adapters=art.PerAgent(agents=many))
        with pytest.raises(RemoteBackendError, match=r"17 agents.*--max-loras") as refused:
            await model.register(RemoteBackend(url, api_key="k"))
    assert refused.value.status == 400 and backend._servers == {}
    assert not any((tmp_path / "art").rglob("checkpoints"))
    owner_sized = InferenceConfig(max_loras=2 * (len(many) + 1))  # the owner's own setting is taken as it is
    assert sized_for_agents(owner_sized, model) is owner_sized
    at_cap = art.TrainableModel(
        name="n", project="p", base_model=base, adapters=art.PerAgent(agents=many[:-1])
    )
    assert sized_for_agents(InferenceConfig(), at_cap).max_loras == 2 * (MAX_AUTO_SIZED_AGENTS + 1)
