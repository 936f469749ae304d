"""gather_on_ray on a local Ray instance: rollouts run in worker processes, groups come back as the driver's."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.backend.remote import RemoteBackend
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from art_adapters.trajectories import RolloutError
from test_remote_backend import FakeBackend, running, trainable

ray = pytest.importorskip("ray")
from art_adapters.ray import gather_on_ray, only_this_host  # noqa: E402


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    tests = str(Path(__file__).parent)  # workers import this module to unpickle the rollout functions
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture
def remote_model(tmp_path: Path) -> Iterator[art.TrainableModel]:
    with ScriptedServer(None) as inference:
        fake = FakeBackend(tmp_path / "art", inference.base_url)
        app = create_app(fake, api_key="ray-key", inference_key="rollout-key", allowed_base_models=["tiny"])
        with running(app) as url:
            yield trainable(), url  # type: ignore[misc]


async def rollout(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
    """Runs on a worker: one recorded chat through the server's proxy, rewarded by the scenario."""
    if scenario.get("fail"):
        raise ValueError(f"scenario {scenario['id']} is broken")
    async with art.capture() as trajectory:
        answer = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": scenario["q"]}]
        )
    trajectory.reward = float(answer.choices[0].message.content == f"echo: {scenario['q']}")
    trajectory.metadata["pid"] = os.getpid()
    trajectory.metadata["step"] = await model.get_step()  # the step the driver dispatched at
    trajectory.metadata["key"] = model.inference_api_key
    if scenario.get("train"):
        await model.delete_checkpoints()  # a worker holding the inference key cannot manage the model
    return trajectory


SCENARIOS = [{"id": k, "q": f"question {k}"} for k in range(3)]


@pytest.mark.parametrize("group_per_task", [False, True])
async def test_groups_come_back_as_from_gather(
    local_ray: Any, remote_model: Any, group_per_task: bool
) -> None:
    model, url = remote_model
    await model.register(RemoteBackend(url, "ray-key"))
    groups = await gather_on_ray(
        rollout, SCENARIOS, 2, model=model, group_per_task=group_per_task, pbar_desc=None
    )
    assert [len(g.trajectories) for g in groups] == [2, 2, 2]
    assert all(t.reward == 1.0 and t.metadata["step"] == 0 for g in groups for t in g)
    assert {t.metadata["key"] for g in groups for t in g} == {"rollout-key"}  # sampled with the inference key
    assert {t.metadata["pid"] for g in groups for t in g} != {os.getpid()}  # ran elsewhere
    call = groups[1].trajectories[0].llm_calls[0]
    assert call.request["messages"][-1]["content"] == "question 1"
    assert call.completion_token_ids  # token ids survived the JSON round trip
    assert groups[1].trajectories[0].messages()[-1] == {"role": "assistant", "content": "echo: question 1"}


async def test_failures_follow_max_exceptions(local_ray: Any, remote_model: Any) -> None:
    model, url = remote_model
    await model.register(RemoteBackend(url, "ray-key"))
    scenarios = [*SCENARIOS[:2], {"id": 9, "q": "x", "fail": True}]
    groups = await gather_on_ray(rollout, scenarios, 2, model=model, max_exceptions=2, pbar_desc=None)
    assert [len(g.trajectories) for g in groups] == [2, 2, 0]
    assert [e["type"] for e in groups[2].exceptions] == ["ValueError", "ValueError"]
    with pytest.raises(RolloutError, match="2 of 6 rollouts failed on Ray.*ValueError: scenario 9 is broken"):
        await gather_on_ray(rollout, scenarios, 2, model=model, max_exceptions=0.2, pbar_desc=None)
    with pytest.raises(ValueError, match="group_size"):
        await gather_on_ray(rollout, scenarios, 0, model=model)


async def test_workers_get_the_inference_key_never_the_admin_key(local_ray: Any, remote_model: Any) -> None:
    """What crosses to the workers (Ray's object store, any host of the cluster) holds no key that trains."""
    import json

    from art_adapters.ray import model_spec

    model, url = remote_model
    await model.register(RemoteBackend(url, "ray-key"))
    assert "ray-key" not in json.dumps(model_spec(model, 3)) and "rollout-key" in json.dumps(
        model_spec(model, 3)
    )
    groups = await gather_on_ray(
        rollout, [{"id": 1, "q": "q", "train": True}], 1, model=model, max_exceptions=1, pbar_desc=None
    )
    assert groups[0].exceptions[0].type == "RuntimeError"
    assert "a Ray rollout worker only samples" in groups[0].exceptions[0].message


async def test_a_loopback_endpoint_is_refused_on_a_cluster_of_several_nodes(
    local_ray: Any, remote_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers on another node would call their own 127.0.0.1; one node (the tests above) is fine."""
    model, url = remote_model
    await model.register(RemoteBackend(url, "ray-key"))
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {**nodes[0], "NodeID": "other", "Alive": True}])
    with pytest.raises(
        ValueError, match=r"on this host's loopback, which the other 1 node\(s\) of the Ray cluster"
    ):
        await gather_on_ray(rollout, SCENARIOS, 1, model=model, pbar_desc=None)


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "127.1", "[::ffff:127.0.0.1]", "127.0.0.2", "LOCALHOST"])
async def test_every_form_of_this_hosts_own_address_is_refused_on_a_cluster(
    host: str, local_ray: Any, remote_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unspecified addresses and short or IPv4-mapped loopback forms each mean the calling node itself."""
    model, url = remote_model
    await model.register(RemoteBackend(url, "ray-key"))
    port = url.rsplit(":", 1)[1]
    model._endpoint = model._endpoint.model_copy(update={"base_url": f"http://{host}:{port}/v1"})
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {**nodes[0], "NodeID": "other", "Alive": True}])
    with pytest.raises(ValueError, match=r"which the other 1 node\(s\) of the Ray cluster cannot reach"):
        await gather_on_ray(rollout, SCENARIOS, 1, model=model, pbar_desc=None)


def test_a_name_is_judged_by_what_it_resolves_to() -> None:
    name = socket.gethostname()
    addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    only_loopback = all(a.startswith("127.") or a in ("::1", "0.0.0.0", "::") for a in addresses)
    assert only_this_host(name) == only_loopback
    assert only_this_host("localhost") and only_this_host("api.localhost")
    assert not only_this_host("192.0.2.7") and not only_this_host("[2001:db8::1]")
    assert not only_this_host("::ffff:192.0.2.7")
    assert not only_this_host("no-such-host.invalid")  # not resolvable here: not judged
