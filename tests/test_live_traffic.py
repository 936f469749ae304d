"""Live traffic: the trajectory store on SQLite and on a real PostgreSQL, the record mode of the recording endpoint
and of `serve` (calls stored, the id in the answer, rewards joined later: idempotent, authenticated, bounded), and
the store as the async pipeline's source (grouped by key, stale and unkeyed ones skipped and counted)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.capture.live import LiveRecorder, Retention
from art_adapters.pipeline import Pipeline, PipelineConfig
from art_adapters.production import StoreSource
from art_adapters.store import RewardConflict, TrajectoryStore, open_store
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import LLMCall
from fixtures_postgres import postgres_url  # noqa: F401 - the session's PostgreSQL server

pytest.importorskip("uvicorn")


def call(text: str, version: int | None = None, t: float = 0.0) -> LLMCall:
    return LLMCall(
        request={"model": "m", "messages": [{"role": "user", "content": text}]},
        response={
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ]
        },
        status_code=200,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        policy_version=version,
        started_at=1000.0 + t,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'traffic.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    with open_store(url) as opened:
        # one server for the session: every test starts empty
        opened._transact(
            lambda cursor: [
                cursor.execute(f"DELETE FROM {t}")
                for t in ("art_calls", "art_trajectories", "art_call_rewards")
            ]
        )
        yield opened


def test_store_rewards_claims_and_retention(store: TrajectoryStore) -> None:
    store.add_call("t1", call("a", t=1), {"group": "g"})
    store.add_call("t1", call("b", t=0))  # calls come back in the order they started
    store.add_call("t2", call("c"))
    assert [c.request["messages"][0]["content"] for c in store.get("t1").llm_calls] == ["b", "a"]
    assert store.get("t1").metadata["group"] == "g" and store.get("nope") is None
    assert store.claim(10) == []  # nothing rewarded yet
    assert store.set_reward("t1", 1.0, {"helpful": 1.0}) == "set"
    assert store.set_reward("t1", 1.0, {"helpful": 1.0}) == "unchanged"  # idempotent
    with pytest.raises(RewardConflict):
        store.set_reward("t1", 0.0)
    with pytest.raises(KeyError):
        store.set_reward("unknown", 1.0)
    with pytest.raises(ValueError):
        store.set_reward("t2", float("nan"))
    with pytest.raises(ValueError):
        store.add_call("../etc", call("x"))
    (claimed,) = store.claim(10)
    assert claimed[0] == "t1" and claimed[1].reward == 1.0 and claimed[1].metrics["helpful"] == 1.0
    assert claimed[1].llm_calls[0].prompt_token_ids == [1, 2, 3]
    assert store.claim(10) == []  # claimed: not handed out twice
    assert [i for i, _ in store.claim(10, lease_s=0.0)] == ["t1"]  # a lease that ran out: claimable again
    store.mark_trained(["t1"])
    assert store.claim(10, lease_s=0.0) == []
    assert store.counts() == {"trajectories": 2, "rewarded": 1, "trained": 1, "calls": 3}
    assert store.prune(max_trajectories=1) == 1 and store.counts()["trajectories"] == 1
    assert store.prune(max_age_s=0.0) == 1 and store.counts() == {
        "trajectories": 0,
        "rewarded": 0,
        "trained": 0,
        "calls": 0,
    }


@pytest.mark.parametrize(
    "look_alike", ["\u043erder-17", "\uff4frder-17", "order-\u00b9\u2077", "\u00c3\u00a9", "order\u200b-17"]
)
def test_trajectory_ids_are_ascii_only(store: TrajectoryStore, look_alike: str) -> None:
    """`str.isalnum()` let a Cyrillic `о`, a fullwidth `ｏ` or superscript digits through: ids that look like
    `order-17` yet are other trajectories (and a header's latin-1 bytes named another id than its UTF-8 path)."""
    store.add_call("order-17", call("a"))
    store.add_call("Run_2.b-3", call("b"))  # ASCII letters, digits and - _ . stay accepted
    with pytest.raises(ValueError, match="ASCII characters of A-Z a-z 0-9 - _ ."):
        store.add_call(look_alike, call("x"))
    with pytest.raises(ValueError, match="ASCII"):
        store.set_reward(look_alike, 1.0)
    assert store.counts()["trajectories"] == 2 and store.counts()["calls"] == 2  # the refusal lost nothing
    assert store.get("order-17") is not None and len(store.get("order-17").llm_calls) == 1


def test_two_trainers_never_claim_the_same_trajectory(store: TrajectoryStore, tmp_path: Path) -> None:
    for k in range(40):
        store.add_call(f"t{k}", call(str(k)))
        store.set_reward(f"t{k}", float(k))
    url = getattr(store, "url", None) or f"sqlite:///{store.path}"  # type: ignore[attr-defined]
    claimed: list[list[str]] = [[], []]

    def claimer(k: int) -> None:
        with open_store(url) as own:
            while batch := own.claim(3):
                claimed[k] += [i for i, _ in batch]

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(claimed[0] + claimed[1]) == sorted(f"t{k}" for k in range(40))
    assert not set(claimed[0]) & set(claimed[1])


def scripted(request: dict[str, Any]) -> Reply:
    return Reply(content=f"answer {len(request['messages'])}")


def test_recording_endpoint_record_mode(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t.db")
    recorder = LiveRecorder(store, retention=Retention(max_trajectories=100, every_calls=1))
    with (
        ScriptedServer(scripted, cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        client = httpx.Client(base_url=ep.base_url, timeout=30)
        first = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi, Bearer abcdefghijklmnop"},
        ]
        one = client.post("/chat/completions", json={"model": "m", "messages": first})
        assert one.status_code == 200
        tid = one.headers["x-art-trajectory"]
        answer = one.json()["choices"][0]["message"]
        follow = [
            *first,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "more"},
        ]
        two = client.post(
            "/chat/completions", json={"model": "m", "messages": follow}, headers={"x-art-group": "faq"}
        )
        assert two.headers["x-art-trajectory"] == tid  # the conversation continues: the same trajectory
        named = client.post(
            "/chat/completions",
            json={"model": "m", "messages": first},
            headers={"x-art-trajectory": "order-17"},
        )
        assert named.headers["x-art-trajectory"] == "order-17"
        assert (
            client.post(
                "/chat/completions",
                json={"model": "m", "messages": first},
                headers={"x-art-trajectory": "../x"},
            ).status_code
            == 400
        )
        rewards = httpx.Client(base_url=f"http://127.0.0.1:{ep.port}", timeout=30)
        auth = {"authorization": f"Bearer {recorder.reward_key}"}
        assert rewards.post(f"/rewards/{tid}", json={"reward": 1.0}).status_code == 401
        assert rewards.post(f"/rewards/{tid}", json={"reward": 1.0}, headers=auth).json()["status"] == "set"
        assert (
            rewards.post(f"/rewards/{tid}", json={"reward": 1.0}, headers=auth).json()["status"]
            == "unchanged"
        )
        assert rewards.post(f"/rewards/{tid}", json={"reward": 0.0}, headers=auth).status_code == 409
        assert rewards.post("/rewards/nobody", json={"reward": 1.0}, headers=auth).status_code == 404
        assert rewards.post("/rewards/order-17", json={"reward": "high"}, headers=auth).status_code == 400
        assert (
            rewards.post(
                "/rewards/order-17", json={"reward": 1, "metrics": {"x": "y"}}, headers=auth
            ).status_code
            == 400
        )
        assert (
            rewards.post("/rewards/order-17", content=b"{" + b" " * 70_000 + b"}", headers=auth).status_code
            == 413
        )
    trajectory = store.get(tid)
    assert trajectory.reward == 1.0 and trajectory.metadata["group"] == "faq"
    assert len(trajectory.llm_calls) == 2 and trajectory.llm_calls[0].completion_token_ids  # the engine's ids
    # the prompts held a secret: their ids (which spell it) were dropped with it
    assert all(c.prompt_token_ids is None for c in trajectory.llm_calls)
    assert "abcdefghijklmnop" not in trajectory.model_dump_json()  # redacted before it was stored
    assert [m["role"] for m in trajectory.messages()] == ["system", "user", "assistant", "user", "assistant"]


@contextlib.asynccontextmanager
async def recording_server(
    tmp_path: Path, reply: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, TrajectoryStore, dict[str, str], dict[str, str]]]:
    """`art serve`'s app in record mode on a scripted upstream, model "agent" registered: the client, the store,
    and the admin and inference keys' headers."""
    from art_adapters.backend.server import create_app
    from test_remote_backend import FakeBackend

    store = open_store(tmp_path / "serve.db")
    with ScriptedServer(reply, cycle=True) as upstream:
        app = create_app(
            FakeBackend(tmp_path / "art", upstream.base_url),
            api_key="admin",
            inference_key="infer",
            allowed_base_models=["tiny"],
            record=LiveRecorder(store),
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            admin, infer = {"authorization": "Bearer admin"}, {"authorization": "Bearer infer"}
            model = art.TrainableModel(name="agent", project="prod", base_model="tiny")
            registered = await client.post(
                "/models/register", json={"model": model.model_dump(mode="json")}, headers=admin
            )
            assert registered.status_code == 200
            yield client, store, admin, infer


async def test_serve_record_mode(tmp_path: Path) -> None:
    async with recording_server(tmp_path, scripted) as (client, store, admin, infer):
        body = {"model": "agent", "messages": [{"role": "user", "content": "hello"}]}
        answer = await client.post("/v1/chat/completions", json=body, headers=infer)
        assert answer.status_code == 200, answer.text
        tid = answer.headers["x-art-trajectory"]
        assert (await client.post(f"/rewards/{tid}", json={"reward": 1}, headers=infer)).status_code == 403
        done = await client.post(f"/rewards/{tid}", json={"reward": 1}, headers=admin)
        assert done.status_code == 200 and done.json()["status"] == "set"
    trajectory = store.get(tid)
    assert trajectory.reward == 1.0 and trajectory.llm_calls[0].completion_token_ids


async def test_serve_record_mode_takes_call_rewards(tmp_path: Path) -> None:
    """`art serve` mounts `POST /rewards/{id}/calls/{n}` beside the trajectory route: admin key only, "set",
    "unchanged", 409 and 404 as the trajectory route answers, and the stored call carries the reward."""

    def numbered(request: dict[str, Any]) -> Reply:
        return Reply(content=f"answer {len(request['messages'])}")

    async with recording_server(tmp_path, numbered) as (client, store, admin, infer):
        named = {**infer, "x-art-trajectory": "run-1"}
        for text in ("one", "two"):
            body = {"model": "agent", "messages": [{"role": "user", "content": text}]}
            answer = await client.post("/v1/chat/completions", json=body, headers=named)
            assert answer.status_code == 200, answer.text

        async def post(path: str, reward: float, headers: dict[str, str] = admin) -> httpx.Response:
            return await client.post(path, json={"reward": reward}, headers=headers)

        assert (await post("/rewards/run-1/calls/1", 0.5, infer)).status_code == 403
        first = await post("/rewards/run-1/calls/1", 0.5)
        assert first.status_code == 200, first.text
        assert first.json() == {"trajectory_id": "run-1", "call": 1, "status": "set"}
        assert (await post("/rewards/run-1/calls/1", 0.5)).json()["status"] == "unchanged"
        assert (await post("/rewards/run-1/calls/1", 0.0)).status_code == 409
        assert (await post("/rewards/run-1/calls/2", 1.0)).status_code == 404
        assert (await post("/rewards/run-1", 1.0)).json()["status"] == "set"
    trajectory = store.get("run-1")
    assert trajectory is not None and trajectory.reward == 1.0
    assert [c.reward for c in trajectory.llm_calls] == [None, 0.5]
    store.close()


async def test_the_store_feeds_the_async_pipeline(tmp_path: Path) -> None:
    from pipeline_fakes import TimedBackend

    store = open_store(tmp_path / "feed.db")
    for k in range(
        7
    ):  # group "a": 4 fresh; "b": 2 sampled by version 0 (stale at step 5); "c": 1 alone; 1 unkeyed
        group = ["a", "a", "a", "a", "b", "b", "c"][k]
        store.add_call(f"t{k}", call(f"q{k}", version=0 if group == "b" else 5), {"group": group})
        store.set_reward(f"t{k}", float(k % 2))
    store.add_call("loose", call("q"))
    store.set_reward("loose", 1.0)
    backend = TimedBackend(tmp_path)
    backend.step = 5
    model = art.TrainableModel(name="agent", project="prod", base_model="tiny")
    await model.register(backend)
    source = StoreSource(
        store, key="group", min_size=2, max_size=2, wait_s=0.0, poll_s=0.01, idle_s=0.3, max_staleness=2
    )
    source.current_step = 5
    config = PipelineConfig(rollout_workers=1, groups_per_step=1, max_steps_off_policy=8)
    pipeline = Pipeline(model, source.rollout, source, on_step=source.on_step, pipeline=config)
    reports = await asyncio.wait_for(pipeline.run(), 60)
    trained = [
        t.metadata["trajectory_id"] for batch in backend.batches for g in batch for t in g.trajectories
    ]
    assert sorted(trained) == ["t0", "t1", "t2", "t3"] and len(reports) == 2
    assert (
        source.stats.skipped_stale == 2
        and source.stats.skipped_unkeyed == 1
        and source.stats.skipped_alone == 1
    )
    assert store.counts()["trained"] == 8  # trained or skipped: none is claimed again
    for k in range(2):  # more traffic; a resumed run skips none of it (the store keeps the source's progress)
        store.add_call(f"d{k}", call(f"qd{k}", version=7), {"group": "d"})
        store.set_reward(f"d{k}", float(k))
    again = Pipeline(model, source.rollout, source, on_step=source.on_step, pipeline=config)
    assert len(await asyncio.wait_for(again.run(), 60)) == 1
    assert {t.metadata["trajectory_id"] for g in backend.batches[-1] for t in g.trajectories} == {"d0", "d1"}
