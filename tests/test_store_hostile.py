"""The trajectory store, its source and the record mode against hostile or unlucky traffic: non-finite numbers (a
-inf logprob vLLM reports for a token it could not have sampled, a NaN reward) round-trip; a row that cannot be
read back is skipped, counted and named, never stopping the others; calls after a reward start a continuation; a
lone UTF-16 surrogate is stored; a lost PostgreSQL connection is replaced; StoreSource never groups a trajectory
with itself, checks staleness before the first claim and when it yields, and refuses sizes that cannot make a
group."""

# ruff: noqa: F811 - the `store` fixture, imported, is each test's parameter
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.capture.live import LiveRecorder
from art_adapters.production import StoreSource
from art_adapters.store import TrajectoryStore, open_store
from art_adapters.store.records import StoreConnectionError, check_id
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import LLMCall, Trajectory, read_jsonl, write_jsonl
from fixtures_postgres import postgres_url  # noqa: F401 - the session's PostgreSQL server
from test_live_traffic import call, store  # noqa: F401 - SQLite and PostgreSQL stores, emptied

pytest.importorskip("uvicorn")


def inf_call(text: str = "q", version: int | None = None) -> LLMCall:
    return call(text, version).model_copy(update={"logprobs": [-0.5, float("-inf")]})


# ---- non-finite numbers --------------------------------------------------------------------------------------------


def test_non_finite_numbers_round_trip_through_the_store(store: TrajectoryStore) -> None:
    store.add_call("inf", inf_call(), {"group": "g"})
    whole = Trajectory(llm_calls=[inf_call()], reward=float("nan"), metrics={"m": float("inf")})
    store.add(whole, "whole")
    for trajectory_id in ("inf", "whole"):
        store.set_reward(trajectory_id, 1.0)
    claimed = dict(store.claim(10))
    assert sorted(claimed) == ["inf", "whole"] and not store.unreadable
    assert claimed["inf"].llm_calls[0].logprobs == [-0.5, -math.inf]
    assert claimed["whole"].llm_calls[0].logprobs == [-0.5, -math.inf]
    assert claimed["whole"].reward == 1.0 and claimed["whole"].metrics["m"] == math.inf


def test_non_finite_numbers_round_trip_through_jsonl(tmp_path: Path) -> None:
    trajectory = Trajectory(llm_calls=[inf_call()], reward=float("nan"), metrics={"m": float("-inf")})
    trajectory.finish()
    path = write_jsonl(tmp_path / "t.jsonl", [trajectory])
    (back,) = read_jsonl(path)
    assert back.llm_calls[0].logprobs == [-0.5, -math.inf] and math.isnan(back.reward)
    assert back.metrics["m"] == -math.inf
    assert json.loads(path.read_text())["llm_calls"][0]["logprobs"] == [-0.5, -math.inf]


async def test_non_finite_numbers_cross_the_remote_backend_wire(tmp_path: Path) -> None:
    import art_adapters as art
    from art_adapters.backend.remote import RemoteBackend
    from art_adapters.backend.server import create_app
    from test_remote_backend import FakeBackend, running

    received: list[Any] = []

    class Keeping(FakeBackend):
        async def train_events(self, model: Any, groups: Any, config: Any, *, record: bool = True) -> Any:
            received.extend(groups)
            async for event in super().train_events(model, groups, config, record=record):
                yield event

    with (
        ScriptedServer(None) as upstream,
        running(
            create_app(
                Keeping(tmp_path / "art", upstream.base_url), api_key="k", allowed_base_models=["tiny"]
            )
        ) as url,
    ):
        backend = RemoteBackend(url, api_key="k")
        model = art.TrainableModel(name="agent", project="p", base_model="tiny")
        await model.register(backend)
        sampled = Trajectory(llm_calls=[inf_call()], reward=1.0, metrics={"m": float("nan")})
        await model.train([art.TrajectoryGroup([sampled, sampled.model_copy(update={"reward": 0.0})])])
        await backend.close()
    (first, _) = received[0].trajectories
    assert first.llm_calls[0].logprobs == [-0.5, -math.inf] and math.isnan(first.metrics["m"])


def test_a_row_that_cannot_be_read_back_is_skipped_counted_and_named(
    store: TrajectoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    for trajectory_id in ("good-1", "bad", "good-2"):
        store.add_call(trajectory_id, call(trajectory_id), {"group": "g"})
        store.set_reward(trajectory_id, 1.0)
    # what an earlier version wrote for a -inf logprob: null, which no float reads back
    poisoned = json.loads(call("bad").model_dump_json())
    poisoned["logprobs"] = [-0.5, None]
    store._transact(
        lambda cursor: cursor.execute(
            store._sql("UPDATE art_calls SET body = ? WHERE trajectory_id = ?"), (json.dumps(poisoned), "bad")
        )
    )
    with caplog.at_level(logging.WARNING, logger="art_adapters.store.sql"):
        claimed = store.claim(10)
    assert [i for i, _ in claimed] == ["good-1", "good-2"]
    assert list(store.unreadable) == ["bad"] and "ValidationError" in store.unreadable["bad"]
    assert "'bad'" in caplog.text
    assert store.counts()["calls"] == 3  # kept: nothing is lost
    assert store.claim(10) == []  # left claimed: not retried on every claim
    assert [i for i, _ in store.claim(10, lease_s=0.0)] == ["good-1", "good-2"]


async def test_a_poisoned_row_never_stops_store_source(tmp_path: Path) -> None:
    store = open_store(tmp_path / "poison.db")
    for trajectory_id in ("a", "b", "c"):
        store.add_call(trajectory_id, call(trajectory_id), {"group": "g"})
        store.set_reward(trajectory_id, float(trajectory_id == "a"))
    store._transact(
        lambda cursor: cursor.execute(
            "UPDATE art_calls SET body = '{\"request\": 1}' WHERE trajectory_id = 'b'"
        )
    )
    source = StoreSource(store, key="group", poll_s=0.01, idle_s=0.2)
    groups = [g async for g in source]
    assert [[t.metadata["trajectory_id"] for t in g.trajectories] for g in groups] == [["a", "c"]]
    assert source.stats.skipped_unreadable == 1


# ---- rewards, calls after them, text -------------------------------------------------------------------------------


def test_a_reward_too_large_for_a_float_is_a_value_error(store: TrajectoryStore) -> None:
    store.add_call("t", call("q"))
    with pytest.raises(ValueError, match="finite"):
        store.set_reward("t", 10**400)
    assert store.set_reward("t", 1) == "set"


def test_calls_after_a_reward_start_a_continuation(store: TrajectoryStore) -> None:
    assert store.add_call("conv", call("turn 0", t=0), {"group": "g"}) == "conv"
    store.set_reward("conv", 1.0)
    assert store.open_id("conv") == "conv.2"
    assert store.add_call("conv", call("turn 1", t=1)) == "conv.2"
    assert store.add_call("conv", call("turn 2", t=2)) == "conv.2"
    assert len(store.get("conv").llm_calls) == 1  # what was rewarded is what trains
    later = store.get("conv.2")
    assert len(later.llm_calls) == 2 and later.metadata["continues"] == "conv"
    assert later.metadata["group"] == "g"  # trains in the group of what it continues
    assert store.set_reward("conv.2", 0.0) == "set"  # its own reward, no conflict
    store.mark_trained([i for i, _ in store.claim(10)])
    assert store.add_call("conv", call("turn 3", t=3)) == "conv.3"
    long = "x" * 128
    store.add_call(long, call("a"))
    store.set_reward(long, 1.0)
    follow = store.add_call(long, call("b"))
    assert follow != long and check_id(follow) and store.get(follow).metadata["continues"] == long


def test_a_lone_surrogate_is_stored_and_read_back(store: TrajectoryStore) -> None:
    half = json.loads('"emoji cut in half: \\ud83d"')
    surrogate = call(half)
    store.add_call("u1", surrogate)
    store.add(Trajectory(llm_calls=[surrogate]), "u2")
    assert store.get("u1").llm_calls[0].request["messages"][0]["content"] == half
    assert store.get("u2").llm_calls[0].request["messages"][0]["content"] == half


# ---- PostgreSQL: a lost connection -----------------------------------------------------------------------------------


def test_postgres_replaces_a_lost_connection(postgres_url: str) -> None:  # noqa: F811
    import psycopg

    with open_store(postgres_url) as store, psycopg.connect(postgres_url, autocommit=True) as admin:
        store.add_call("pg-before", call("a"))
        pid = store._connection.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))  # what a restart or failover does to it
        assert store.add_call("pg-after", call("b")) == "pg-after"  # reconnected, the transaction retried
        assert store._connection.info.backend_pid != pid
        assert store.get("pg-after") is not None and store.get("pg-before") is not None
        # a server that stays away: one reconnect, then a clear error; the next call reconnects once it is back
        url, store.url = store.url, "postgresql://art:x@127.0.0.1:9/postgres"
        admin.execute("SELECT pg_terminate_backend(%s)", (store._connection.info.backend_pid,))
        with pytest.raises(StoreConnectionError, match="cannot reconnect"):
            store.add_call("pg-lost", call("c"))
        store.url = url
        assert store.add_call("pg-back", call("d")) == "pg-back"
        assert store.get("pg-lost") is None
        store._transact(
            lambda cursor: cursor.execute("DELETE FROM art_calls WHERE trajectory_id LIKE 'pg-%%'")
        )
        store._transact(lambda cursor: cursor.execute("DELETE FROM art_trajectories WHERE id LIKE 'pg-%%'"))


# ---- StoreSource ---------------------------------------------------------------------------------------------------


class Model:
    """What the source asks of a model: its current step."""

    def __init__(self, step: int) -> None:
        self.step = step

    async def get_step(self) -> int:
        return self.step


async def until(condition: Any, what: str) -> None:
    """Yield to the loop until `condition()` holds (bounded: a source that never gets there fails the test)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def add(store: TrajectoryStore, trajectory_id: str, version: int = 0, reward: float = 1.0) -> None:
    store.add_call(trajectory_id, call(trajectory_id, version), {"group": "A"})
    store.set_reward(trajectory_id, reward)


async def test_a_trajectory_is_never_grouped_with_itself(tmp_path: Path) -> None:
    store = open_store(tmp_path / "lease.db")
    add(store, "only")
    # a lease that lapses at once: every claim hands the waiting trajectory back to the source that holds it
    source = StoreSource(store, key="group", poll_s=0.01, idle_s=0.3, lease_s=1e-9)
    assert [g async for g in source] == []
    assert source.stats.trajectories == 1 and source.stats.groups == 0
    assert [i for i, _ in store.claim(10)] == ["only"]  # released when the source ended


async def test_claims_of_waiting_trajectories_are_renewed(tmp_path: Path) -> None:
    store = open_store(tmp_path / "renew.db")
    add(store, "waits")
    source = StoreSource(store, key="group", poll_s=0.01, idle_s=None)
    assert source.lease_s >= source.wait_s  # a claim outlasts the wait for a partner
    source.renew_s = 0.0
    consumer = asyncio.create_task(anext(source.groups()))
    try:
        await until(lambda: source.stats.trajectories == 1, "the trajectory claimed")
        # an hour later (the claim aged in the file): the source renews what it holds
        store._transact(
            lambda cursor: cursor.execute("UPDATE art_trajectories SET claimed_at = claimed_at - 3600")
        )
        await until(lambda: time.time() - claimed_at(store) < 600, "the claim renewed")
        with open_store(tmp_path / "renew.db") as other:  # another trainer, the store's default lease
            assert other.claim(10) == []
        assert not consumer.done()
    finally:
        consumer.cancel()


def claimed_at(store: TrajectoryStore) -> float:
    return store._transact(
        lambda cursor: cursor.execute("SELECT claimed_at FROM art_trajectories").fetchone()[0]
    )


async def test_staleness_is_checked_before_the_first_claim(tmp_path: Path) -> None:
    store = open_store(tmp_path / "stale.db")
    for k in range(4):
        add(store, f"t{k}", version=0, reward=float(k % 2))
    with pytest.raises(ValueError, match="model="):
        [g async for g in StoreSource(store, key="group", max_staleness=0)]
    source = StoreSource(store, key="group", poll_s=0.01, idle_s=0.2, max_staleness=0, model=Model(5))
    assert [g async for g in source] == []
    assert source.stats.skipped_stale == 4
    fresh = StoreSource(store, key="group", poll_s=0.01, idle_s=0.2, max_staleness=5, model=Model(5))
    add(store, "u0", version=0)
    add(store, "u1", version=0, reward=0.0)
    assert [len(g) async for g in fresh] == [2]


async def test_staleness_is_checked_again_when_a_group_is_yielded(tmp_path: Path) -> None:
    store = open_store(tmp_path / "waiting.db")
    model = Model(0)
    add(store, "old", version=0)
    source = StoreSource(store, key="group", poll_s=0.01, idle_s=0.3, max_staleness=2, model=model)
    consumer = asyncio.create_task(anext(source.groups(), None))
    await until(lambda: source.stats.trajectories == 1, "the old trajectory claimed")
    model.step = 10  # the model trained on while it waited for a partner
    add(store, "new", version=10, reward=0.0)
    assert await consumer is None  # no group: the old one went stale, the new one is alone
    assert source.stats.skipped_stale == 1 and source.stats.trajectories == 2


@pytest.mark.parametrize(
    "sizes", [{"min_size": 0}, {"max_size": 0}, {"min_size": 3, "max_size": 2}, {"claim": 0}, {"poll_s": -1}]
)
def test_sizes_that_cannot_make_a_group_are_refused(tmp_path: Path, sizes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(sizes))):
        StoreSource(open_store(tmp_path / "sizes.db"), **sizes)


async def test_the_source_yields_to_the_event_loop_between_groups(tmp_path: Path) -> None:
    store = open_store(tmp_path / "loop.db")
    for k in range(3):
        add(store, f"t{k}")
    source = StoreSource(store, key="group", min_size=1, max_size=1, poll_s=0.01, idle_s=0.2)
    ran: list[int] = []
    seen: list[int] = []
    tasks = []

    async def other() -> None:
        ran.append(1)

    async for _ in source:
        seen.append(len(ran))
        tasks.append(asyncio.create_task(other()))
    await asyncio.gather(*tasks)
    assert seen == [0, 1, 2]  # each group came after the loop ran what the one before scheduled


# ---- record mode -----------------------------------------------------------------------------------------------------


def greeting(request: dict[str, Any]) -> Reply:
    return Reply(content="Hello! How can I help?")  # the same answer for everyone


def test_two_users_opening_alike_are_never_merged(tmp_path: Path) -> None:
    store = open_store(tmp_path / "users.db")
    with (
        ScriptedServer(greeting, cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=LiveRecorder(store)) as ep,
    ):
        client = httpx.Client(base_url=ep.base_url, timeout=30)

        def ask(messages: list[dict[str, Any]]) -> str:
            answer = client.post("/chat/completions", json={"model": "m", "messages": messages})
            assert answer.status_code == 200
            return answer.headers["x-art-trajectory"]

        opening = [{"role": "system", "content": "You are a support bot."}, {"role": "user", "content": "hi"}]
        reply = {"role": "assistant", "content": "Hello! How can I help?"}
        alice, bob = ask(opening), ask(opening)
        alice_2 = ask([*opening, reply, {"role": "user", "content": "I am ALICE"}])
        bob_2 = ask([*opening, reply, {"role": "user", "content": "I am BOB"}])
        assert (
            len({alice, bob, alice_2, bob_2}) == 4
        )  # ambiguous: nobody's conversation is merged into another's
        # one conversation continued once joins its trajectory; a second, different continuation is a branch
        carol = ask([{"role": "user", "content": "carol here"}])
        carol_2 = ask(
            [{"role": "user", "content": "carol here"}, reply, {"role": "user", "content": "order 3"}]
        )
        again = ask(
            [{"role": "user", "content": "carol here"}, reply, {"role": "user", "content": "order 3"}]
        )
        branch = ask(
            [{"role": "user", "content": "carol here"}, reply, {"role": "user", "content": "order 4"}]
        )
        assert carol_2 == carol and again == carol and branch != carol
    for trajectory_id in (alice, bob, alice_2, bob_2):
        texts = [m["content"] for c in store.get(trajectory_id).llm_calls for m in c.request["messages"]]
        assert not ("I am ALICE" in texts and "I am BOB" in texts)


def test_calls_after_a_reward_are_recorded_in_a_continuation(tmp_path: Path) -> None:
    store = open_store(tmp_path / "after.db")
    recorder = LiveRecorder(store)
    with (
        ScriptedServer(greeting, cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        client = httpx.Client(base_url=ep.base_url, timeout=30)
        rewards = httpx.Client(base_url=f"http://127.0.0.1:{ep.port}", timeout=30)
        auth = {"authorization": f"Bearer {recorder.require_key()}"}
        first = [{"role": "user", "content": "hi"}]
        named = {"x-art-trajectory": "conv", "x-art-group": "faq"}
        assert (
            client.post("/chat/completions", json={"model": "m", "messages": first}, headers=named).headers[
                "x-art-trajectory"
            ]
            == "conv"
        )
        assert rewards.post("/rewards/conv", json={"reward": 1.0}, headers=auth).json()["status"] == "set"
        named = {"x-art-trajectory": "conv"}  # the later call names no group: its continuation keeps conv's
        later = client.post("/chat/completions", json={"model": "m", "messages": first}, headers=named)
        assert later.headers["x-art-trajectory"] == "conv.2"
        assert rewards.post("/rewards/conv.2", json={"reward": 0.0}, headers=auth).json()["status"] == "set"
        # a conversation (no header) rewarded, then continued
        first = [{"role": "user", "content": "hello"}]
        tid = client.post("/chat/completions", json={"model": "m", "messages": first}).headers[
            "x-art-trajectory"
        ]
        assert rewards.post(f"/rewards/{tid}", json={"reward": 1.0}, headers=auth).status_code == 200
        reply = {"role": "assistant", "content": "Hello! How can I help?"}
        more = [*first, reply, {"role": "user", "content": "more"}]
        assert (
            client.post("/chat/completions", json={"model": "m", "messages": more}).headers[
                "x-art-trajectory"
            ]
            == f"{tid}.2"
        )
    assert len(store.get("conv").llm_calls) == 1 and len(store.get("conv.2").llm_calls) == 1
    assert store.get(f"{tid}.2").metadata["continues"] == tid and recorder.failed == 0
    assert store.get("conv.2").metadata["group"] == "faq"


def test_a_reward_too_large_for_a_float_is_a_400(tmp_path: Path) -> None:
    recorder = LiveRecorder(open_store(tmp_path / "big.db"))
    with (
        ScriptedServer(greeting, cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        answer = httpx.post(
            f"{ep.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "q"}]},
        )
        url = f"http://127.0.0.1:{ep.port}/rewards/{answer.headers['x-art-trajectory']}"
        auth = {"authorization": f"Bearer {recorder.require_key()}", "content-type": "application/json"}
        huge = b"1" + b"0" * 400
        for body in (b'{"reward": ' + huge + b"}", b'{"reward": 1, "metrics": {"m": ' + huge + b"}}"):
            refused = httpx.post(url, content=body, headers=auth)
            assert refused.status_code == 400 and "finite number" in refused.json()["detail"]
            assert len(refused.json()["detail"]) < 200


def test_a_lone_surrogate_is_recorded(tmp_path: Path) -> None:
    store = open_store(tmp_path / "surrogate.db")
    recorder = LiveRecorder(store)
    vllm_like = {
        "id": "x",
        "object": "chat.completion",
        "model": "m",
        "created": 0,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
    }
    with (
        ScriptedServer([Reply(raw_body=json.dumps(vllm_like))]) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "emoji cut in half: \\ud83d"}]}'
        answer = httpx.post(
            f"{ep.base_url}/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200
    stored = store.get(answer.headers["x-art-trajectory"])
    assert recorder.failed == 0 and stored is not None
    assert stored.llm_calls[0].request["messages"][0]["content"] == "emoji cut in half: \ud83d"
