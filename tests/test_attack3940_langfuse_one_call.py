"""Attack on per-call rewards through Langfuse (issue 40), a case the team's round trip (two-call trajectories) left
out: a one-call trajectory whose call has its own reward, where a score on the only generation could be taken for
the trace's. It comes back with its call reward and its trajectory reward apart (this held)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytest.importorskip("langfuse")


@pytest.fixture
def langfuse() -> Any:
    from art_adapters.testing.langfuse_api import LangfuseAPIServer

    public, secret = f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


def _one_call(t0: float, reward: float, call_reward: float | None) -> Trajectory:
    call = LLMCall(
        request={"model": "agent", "messages": [{"role": "user", "content": "go"}]},
        response={
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
            ]
        },
        status_code=200,
        url="http://x/v1/chat/completions",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        started_at=t0,
        latency_s=0.1,
        reward=call_reward,
    )
    return Trajectory(llm_calls=[call], reward=reward, start_time=t0).finish()


def test_a_one_call_trajectory_keeps_its_call_reward_through_langfuse(langfuse: Any) -> None:
    from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories

    t0 = time.time() - 60
    originals = [_one_call(t0, 1.0, 0.5), _one_call(t0 + 5, 0.0, None)]
    exporter = LangfuseExporter(langfuse.public_key, langfuse.secret_key, langfuse.base_url)
    exporter.export(TrajectoryGroup(originals), step=1)
    assert exporter.flush(20)
    exporter.close()
    assert langfuse.wait_for(2, scores=3)  # two trajectory rewards, one generation score
    imported = import_trajectories(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False
    )
    back = sorted(imported, key=lambda t: t.start_time)
    assert [t.reward for t in back] == [1.0, 0.0]
    assert [[c.reward for c in t.llm_calls] for t in back] == [[0.5], [None]]
