"""Per-call rewards wherever rewards come from: the recording endpoint's `POST /rewards/{id}/calls/{n}` (same key,
bounds and idempotence as the trajectory route) into the store; Langfuse scores on generations, both ways, through
the real SDK and the local Langfuse API; OTel reward attributes on chat spans."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_adapters.capture.endpoint import RecordingEndpoint
from art_adapters.capture.live import LiveRecorder
from art_adapters.store import RewardConflict, open_store
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytest.importorskip("uvicorn")


def test_call_rewards_through_the_recording_endpoint(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t.db")
    recorder = LiveRecorder(store)
    with (
        ScriptedServer(lambda r: Reply(content=f"answer {len(r['messages'])}"), cycle=True) as upstream,
        RecordingEndpoint(upstream.base_url, record=recorder) as ep,
    ):
        client = httpx.Client(base_url=ep.base_url, timeout=30)
        named = {"x-art-trajectory": "run-1"}
        for text in ("one", "two", "three"):
            reply = client.post(
                "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": text}]},
                headers=named,
            )
            assert reply.status_code == 200
        rewards = httpx.Client(base_url=f"http://127.0.0.1:{ep.port}", timeout=30)
        auth = {"authorization": f"Bearer {recorder.reward_key}"}

        def post(path: str, body: Any = None, headers: dict[str, str] | None = auth, **kw: Any) -> Any:
            return rewards.post(path, json=body, headers=headers, **kw)

        assert post("/rewards/run-1/calls/0", {"reward": 0.5}, headers=None).status_code == 401
        first = post("/rewards/run-1/calls/0", {"reward": 0.5, "metrics": {"tests": 3}})
        assert first.status_code == 200 and first.json() == {
            "trajectory_id": "run-1",
            "call": 0,
            "status": "set",
        }
        again = post("/rewards/run-1/calls/0", {"reward": 0.5, "metrics": {"tests": 3}})
        assert again.json()["status"] == "unchanged"
        assert post("/rewards/run-1/calls/0", {"reward": 0.0}).status_code == 409
        assert post("/rewards/run-1/calls/2", {"reward": -1, "metadata": {"why": "late"}}).status_code == 200
        missing = post("/rewards/run-1/calls/3", {"reward": 1.0})
        assert missing.status_code == 404 and "3 recorded call(s)" in missing.json()["detail"]
        assert post("/rewards/nobody/calls/0", {"reward": 1.0}).status_code == 404
        for bad in ("-1", "x", "1e3", "0x1", "9999999999"):
            assert post(f"/rewards/run-1/calls/{bad}", {"reward": 1.0}).status_code in (400, 404), bad
        assert post("/rewards/run-1/calls/1", {"reward": "NaN"}).status_code == 400
        nan = rewards.post(
            "/rewards/run-1/calls/1",
            content=b'{"reward": NaN}',
            headers={**auth, "content-type": "application/json"},
        )
        assert nan.status_code == 400
        big = rewards.post("/rewards/run-1/calls/1", content=b"{" + b" " * 70_000 + b"}", headers=auth)
        assert big.status_code == 413
        # the trajectory stays open for more calls, and its own reward closes it as before
        assert post("/rewards/run-1", {"reward": 1.0}).json()["status"] == "set"
    trajectory = store.get("run-1")
    assert trajectory is not None and trajectory.reward == 1.0
    assert [c.reward for c in trajectory.llm_calls] == [0.5, None, -1.0]
    assert trajectory.metrics["call0/tests"] == 3.0 and trajectory.metadata["call2/why"] == "late"
    ((_, claimed),) = store.claim(5)
    assert [c.reward for c in claimed.llm_calls] == [0.5, None, -1.0]
    with pytest.raises(RewardConflict):
        store.set_call_reward("run-1", 2, 0.0)
    with pytest.raises(ValueError, match="finite"):
        store.set_call_reward("run-1", 1, float("inf"))
    with pytest.raises(IndexError):
        store.set_call_reward("run-1", -1, 0.0)
    # a whole trajectory stored at once (an import, the OTLP endpoint): its calls are counted from its body
    store.add(Trajectory(llm_calls=[LLMCall(request={})] * 2), "whole")
    assert store.set_call_reward("whole", 1, 2.0) == "set"
    with pytest.raises(IndexError, match="2 recorded"):
        store.set_call_reward("whole", 2, 2.0)
    whole = store.get("whole")
    assert whole is not None and [c.reward for c in whole.llm_calls] == [None, 2.0]
    store.close()


# ---- Langfuse ---------------------------------------------------------------------------------------------------

langfuse_sdk = pytest.importorskip("langfuse")


@pytest.fixture
def langfuse() -> Any:
    import uuid

    from art_adapters.testing.langfuse_api import LangfuseAPIServer

    public, secret = f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


def _two_call_trajectory(t0: float, reward: float, call_rewards: list[float | None]) -> Trajectory:
    calls = []
    for k, call_reward in enumerate(call_rewards):
        messages = [{"role": "user", "content": f"step {k}"}]
        calls.append(
            LLMCall(
                request={"model": "agent", "messages": messages},
                response={
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"ok {k}"},
                        }
                    ]
                },
                status_code=200,
                url="http://x/v1/chat/completions",
                prompt_token_ids=[1, 2, 3 + k],
                completion_token_ids=[4, 5],
                logprobs=[-0.5, -0.25],
                started_at=t0 + k,
                latency_s=0.1,
                reward=call_reward,
            )
        )
    return Trajectory(llm_calls=calls, reward=reward, start_time=t0).finish()


def test_call_rewards_round_trip_through_langfuse(langfuse: Any) -> None:
    from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories

    t0 = time.time() - 60
    originals = [_two_call_trajectory(t0, 1.0, [0.25, None]), _two_call_trajectory(t0 + 5, 0.0, [None, -0.5])]
    exporter = LangfuseExporter(langfuse.public_key, langfuse.secret_key, langfuse.base_url)
    exporter.export(TrajectoryGroup(originals), step=1)
    assert exporter.flush(20)
    exporter.close()
    assert langfuse.wait_for(2, scores=4)  # two trajectory rewards, two generation scores
    on_generations = [s for s in langfuse.scores if s.get("_observationId")]
    assert sorted(s["value"] for s in on_generations) == [-0.5, 0.25]
    imported = import_trajectories(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False
    )
    back = sorted(imported, key=lambda t: t.start_time)
    assert [t.reward for t in back] == [1.0, 0.0]
    assert [[c.reward for c in t.llm_calls] for t in back] == [[0.25, None], [None, -0.5]]


FOREIGN_GENERATIONS = """
    from langfuse import get_client
    langfuse = get_client()
    with langfuse.start_as_current_observation(as_type="span", name="agent") as span:
        for k, reward in enumerate([0.75, None, 0.0]):
            with langfuse.start_as_current_observation(
                as_type="generation", name="chat", model="gpt-prod",
                input=[{{"role": "user", "content": f"turn {{k}}"}}],
                output={{"role": "assistant", "content": f"done {{k}}"}},
            ) as generation:
                pass
            if reward is not None:
                langfuse.create_score(name="reward", value=reward, trace_id=span.trace_id, observation_id=generation.id)
        langfuse.create_score(name="other", value=2.0, trace_id=span.trace_id, observation_id=span.id)
    langfuse.flush()
"""


def test_langfuse_scores_on_foreign_generations_become_call_rewards(langfuse: Any) -> None:
    import os

    from art_adapters.tracing.langfuse import import_trajectories

    env = {k: v for k, v in os.environ.items() if not k.startswith("LANGFUSE")}
    env |= {
        "LANGFUSE_PUBLIC_KEY": langfuse.public_key,
        "LANGFUSE_SECRET_KEY": langfuse.secret_key,
        "LANGFUSE_BASE_URL": langfuse.base_url,
    }
    code = textwrap.dedent(FOREIGN_GENERATIONS).format()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert langfuse.wait_for(1, scores=3)
    imported = import_trajectories(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False
    )
    (trajectory,) = imported.to_list()
    assert [c.reward for c in trajectory.llm_calls] == [0.75, None, 0.0]
    # no trace-level reward: the calls carry them, so it is not "reward missing"; a span's score is the trace's
    assert trajectory.reward == 0.0 and "reward_missing" not in trajectory.metadata
    assert trajectory.metrics["other"] == 2.0


# ---- OTel ------------------------------------------------------------------------------------------------------


def test_otel_reward_attributes_on_chat_spans_become_call_rewards(tmp_path: Path) -> None:
    from art_adapters.tracing.otel_genai import read_otlp
    from test_otel_genai import CURRENT, SECOND, TRACE, export_request, span

    spans = [
        span(TRACE, "a" * 16, None, "invoke_agent", 100, {"app.reward": 0.5}),
        span(TRACE, "b" * 16, "a" * 16, "chat gpt-prod", 100, {**CURRENT, "app.reward": 1.0}),
        span(TRACE, "d" * 16, "a" * 16, "chat gpt-prod", 102, SECOND),
    ]
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(export_request(spans)))
    (trajectory,) = read_otlp(path, reward="app.reward")
    assert trajectory.reward == 0.5  # the agent span's: the trajectory's
    assert [c.reward for c in trajectory.llm_calls] == [1.0, None]
    # only chat spans carry it: the calls hold the rewards, the trajectory is not reward-missing
    spans[0] = span(TRACE, "a" * 16, None, "invoke_agent", 100, {})
    spans[2] = span(TRACE, "d" * 16, "a" * 16, "chat gpt-prod", 102, {**SECOND, "app.reward": 0.0})
    path.write_text(json.dumps(export_request(spans)))
    (trajectory,) = read_otlp(path, reward="app.reward")
    assert [c.reward for c in trajectory.llm_calls] == [1.0, 0.0]
    assert trajectory.reward == 0.0 and "reward_missing" not in trajectory.metadata


# ---- over the wire -----------------------------------------------------------------------------------------------


async def test_estimator_settings_and_call_rewards_travel_to_a_remote_backend(tmp_path: Path) -> None:
    """The real server over a backend that keeps what it was sent: TrainConfig's estimator settings and each call's
    reward arrive as given; a state_key function is refused before anything is sent."""
    import art_adapters as art
    from art_adapters.backend.remote import RemoteBackend
    from art_adapters.backend.server import create_app
    from test_remote_backend import FakeBackend, running

    received: list[tuple[Any, Any]] = []

    class Keeping(FakeBackend):
        async def train_events(self, model: Any, groups: Any, config: Any, *, record: bool = True) -> Any:
            received.append((groups, config))
            async for event in super().train_events(model, groups, config, record=record):
                yield event

    with ScriptedServer(None) as scripted:
        fake = Keeping(tmp_path / "art", scripted.base_url)
        with running(create_app(fake, api_key="server-key", allowed_base_models=["tiny"])) as url:
            backend = RemoteBackend(url, api_key="server-key")
            model = art.TrainableModel(name="agent-1", project="proj", base_model="tiny")
            await model.register(backend)
            trajectory = _two_call_trajectory(time.time(), 1.0, [0.25, None])
            config = art.TrainConfig(advantage="gigpo", gamma=0.9, gigpo_weight=0.5)
            await model.train([TrajectoryGroup([trajectory])], config)
            ((groups, sent),) = received
            assert (sent.advantage, sent.gamma, sent.gigpo_weight) == ("gigpo", 0.9, 0.5)
            assert [c.reward for c in groups[0].trajectories[0].llm_calls] == [0.25, None]
            keyed = art.TrainConfig(advantage="gigpo", state_key=lambda call: None)
            with pytest.raises(ValueError, match="cannot be sent to another process"):
                await model.train([TrajectoryGroup([trajectory])], keyed)
            assert len(received) == 1  # nothing reached the server
            await backend.close()
