"""Traces back into Trajectories through the real `langfuse` SDK client, against a local server speaking Langfuse's
public API (art_adapters.testing.langfuse_api): our own traces bit for bit; foreign ones (the `langfuse.openai`
wrapper, the LangChain CallbackHandler) without sampled ids and flagged; scores as rewards; pages; filters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest

pytest.importorskip("langfuse")
pytest.importorskip("opentelemetry.proto")

from art_adapters.calls import SampledChoice  # noqa: E402
from art_adapters.testing import Reply, ScriptedServer  # noqa: E402
from art_adapters.testing.langfuse_api import LangfuseAPIServer  # noqa: E402
from art_adapters.tracing._records import pack_call  # noqa: E402
from art_adapters.tracing.langfuse import LangfuseExporter, import_trajectories  # noqa: E402
from art_adapters.trajectories import History, LLMCall, Trajectory, TrajectoryGroup  # noqa: E402
from test_langfuse import tool_trajectory  # noqa: E402


def keys() -> tuple[str, str]:
    return f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def langfuse():
    public, secret = keys()
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


def export(server: Any, items: Any, **kwargs: Any) -> list[str]:
    exporter = LangfuseExporter(server.public_key, server.secret_key, server.base_url, **kwargs)
    ids = exporter.export(items, step=kwargs.pop("step", 3) if "step" in kwargs else 3)
    assert exporter.flush(20)
    exporter.close()
    return ids


def rich_trajectory(t0: float, reward: float) -> Trajectory:
    """Token ids, float32 and float64 logprobs, n=2 choices, versions, sources and a sub-agent history."""
    trajectory = tool_trajectory(t0, reward)
    first = trajectory.llm_calls[0]
    first.logprobs = [-0.1, -0.123456789012345, float("-inf"), -2.5, -0.0, -1e-9, -3.0, -0.5, -0.25]
    first.policy_version, first.served_model = 2, "proj/agent@2"
    first.source = first.source.model_copy(
        update={"framework": "langgraph", "node": "agent", "role": "planner"}
    )
    first.other_choices = [SampledChoice(index=1, token_ids=[7, 8, 70000], logprobs=[-0.5, -0.25, -1.0])]
    helper = LLMCall(
        request={"model": "agent-1", "messages": [{"role": "user", "content": "summarise"}]},
        response={
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
            ]
        },
        status_code=200,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.75, -0.125],
        started_at=t0 + 0.5,
        latency_s=0.01,
        policy_version=3,
        source={"framework": "openai", "role": "summariser"},  # type: ignore[arg-type]
    )
    trajectory.additional_histories = [
        History(messages_and_choices=[{"role": "user", "content": "summarise"}], llm_calls=[helper])
    ]
    trajectory.rewards_by_role = {"planner": reward, "summariser": 0.5}
    trajectory.initial_policy_version, trajectory.final_policy_version = 2, 3
    trajectory.logs = ["planned", "answered"]
    return trajectory


CALL_FIELDS = (
    "request",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "other_choices",
    "policy_version",
    "served_model",
    "source",
    "started_at",
    "latency_s",
    "status_code",
    "url",
    "error",
)


def assert_same_call(a: LLMCall, b: LLMCall) -> None:
    for name in CALL_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert a.response_message() == b.response_message()


def test_own_traces_come_back_bit_for_bit(langfuse: LangfuseAPIServer) -> None:
    t0 = time.time() - 60
    originals = [rich_trajectory(t0 + i, reward=float(i)) for i in range(3)]
    export(langfuse, TrajectoryGroup(originals))
    assert langfuse.wait_for(3, scores=3)
    imported = import_trajectories(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False
    )
    back = sorted(imported, key=lambda t: t.reward)
    assert imported.stats.own == 3 and imported.stats.foreign == 0 and imported.stats.imported == 3
    for original, copy in zip(originals, back, strict=True):
        assert copy.reward == original.reward and copy.rewards_by_role == original.rewards_by_role
        assert copy.metrics == original.metrics and copy.logs == original.logs
        assert (copy.initial_policy_version, copy.final_policy_version) == (2, 3)
        assert copy.start_time == original.start_time and copy.end_time == original.end_time
        assert copy.messages() == original.messages() and copy.tools == original.tools
        assert len(copy.llm_calls) == 2
        for a, b in zip(original.llm_calls, copy.llm_calls, strict=True):
            assert_same_call(a, b)
        (history,) = copy.additional_histories
        assert_same_call(original.additional_histories[0].llm_calls[0], history.llm_calls[0])
        assert history.messages() == original.additional_histories[0].messages()
        assert copy.metadata["scenario_id"] == "s-1" and copy.metadata["trace_source"] == "art_adapters"
    # the metadata was read through `expandMetadata`: Langfuse cuts longer values at 200 characters otherwise
    assert any(path == "/api/public/v2/observations" for method, path in langfuse.requests if method == "GET")


def test_pages_filters_limits_and_scores(langfuse: LangfuseAPIServer) -> None:
    t0 = time.time() - 600
    trajectories = [tool_trajectory(t0 + i, reward=i / 10) for i in range(7)]
    exporter = LangfuseExporter(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, session_id="A", tags=["prod"]
    )
    exporter.export(trajectories[:5], step=1)
    assert exporter.flush(20)
    exporter.session_id, exporter.tags = "B", []  # one SDK client per key: the same exporter, another session
    exporter.export(trajectories[5:], step=1)
    assert exporter.flush(20)
    exporter.close()
    assert langfuse.wait_for(7, scores=7 * 3)

    def run(**kwargs: Any) -> tuple[list[Trajectory], Any]:
        imported = import_trajectories(
            langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False, **kwargs
        )
        return imported.to_list(), imported.stats

    everything, stats = run(page_size=3)
    assert len(everything) == 7 and stats.pages == 3
    tagged, _ = run(tags=["prod"])
    assert len(tagged) == 5 and all(t.metadata["trace_source"] == "art_adapters" for t in tagged)
    session, _ = run(session_id="B")
    assert sorted(t.reward for t in session) == [0.5, 0.6]
    limited, stats = run(limit=4, page_size=3)
    assert len(limited) == 4 and stats.traces == 4
    good, stats = run(min_scores={"reward": 0.4})
    assert sorted(t.reward for t in good) == [0.4, 0.5, 0.6] and stats.skipped_by_score == 4
    combined, _ = run(reward=lambda s: s["reward"] + 10 * s["correct"])  # several scores, the user's function
    assert sorted(t.reward for t in combined) == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 10.6]
    window, _ = run(from_time=_dt(t0 + 2.5), to_time=_dt(t0 + 5.5))
    assert sorted(t.reward for t in window) == [0.3, 0.4, 0.5]
    with pytest.raises(ValueError, match="page_size"):
        run(page_size=500)


def _dt(t: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, tz=UTC)


def test_wrong_keys_are_an_error_not_an_empty_import(langfuse: LangfuseAPIServer) -> None:
    from langfuse.api.core.api_error import ApiError

    with pytest.raises(ApiError):
        import_trajectories("pk-lf-wrong", "sk-lf-wrong", langfuse.base_url, progress=False).to_list()


def _foreign_traffic(server: LangfuseAPIServer, script: str, answers: list[str]) -> None:
    """Run `script` in its own process (langfuse.openai patches the openai module it imports)."""
    with ScriptedServer([Reply(content=a) for a in answers]) as model:
        code = textwrap.dedent(script).format(model=model.base_url)
        env = {
            "LANGFUSE_PUBLIC_KEY": server.public_key,
            "LANGFUSE_SECRET_KEY": server.secret_key,
            "LANGFUSE_BASE_URL": server.base_url,
        }
        done = subprocess.run(
            [sys.executable, "-c", code], env={**_env(), **env}, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr[-3000:]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("LANGFUSE")}


OPENAI_WRAPPER = """
    from langfuse import get_client
    from langfuse.openai import OpenAI
    langfuse = get_client()
    client = OpenAI(base_url="{model}", api_key="sk-live-0123456789abcdefghij", max_retries=0)
    for i, (reward, grade) in enumerate([(1.0, "good"), (0.0, "bad")]):
        with langfuse.start_as_current_observation(as_type="span", name="support-agent") as span:
            client.chat.completions.create(model="gpt-prod", temperature=0.7, messages=[
                {{"role": "system", "content": "Be brief."}},
                {{"role": "user", "content": f"question {{i}}: my key is sk-live-0123456789abcdefghij"}}])
            langfuse.create_score(name="reward", value=reward, trace_id=span.trace_id)
            langfuse.create_score(name="grade", value=grade, trace_id=span.trace_id, data_type="CATEGORICAL")
    langfuse.flush()
"""


def test_langfuse_openai_wrapper_traces_import_without_ids(langfuse: LangfuseAPIServer) -> None:
    _foreign_traffic(langfuse, OPENAI_WRAPPER, ["Answer zero", "Answer one"])
    assert langfuse.wait_for(2, scores=4)
    imported = import_trajectories(
        langfuse.public_key,
        langfuse.secret_key,
        langfuse.base_url,
        progress=False,
        reward="grade",
        categories={"grade": {"good": 1.0, "bad": -1.0}},
    )
    trajectories = sorted(imported, key=lambda t: t.reward)
    assert imported.stats.foreign == 2 and imported.stats.own == 0
    assert [t.reward for t in trajectories] == [-1.0, 1.0]
    for trajectory in trajectories:
        assert trajectory.metadata["trace_source"] == "langfuse.openai"
        assert trajectory.metadata["sampled_token_ids"] is False
        (call,) = trajectory.llm_calls
        assert call.prompt_token_ids is None and call.completion_token_ids is None
        assert call.request["temperature"] == 0.7 and call.model == "gpt-prod"
        messages = trajectory.messages()
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert "sk-live" not in str(trajectory.model_dump())  # the default redaction
        assert messages[-1]["content"].startswith("Answer")
    # a reward category the mapping lacks: that trace has no reward (counted, warned), the rest imports
    partial = import_trajectories(
        langfuse.public_key,
        langfuse.secret_key,
        langfuse.base_url,
        progress=False,
        reward="grade",
        categories={"grade": {"good": 1.0}},
    )
    assert [t.reward for t in partial.to_list()] == [1.0]
    assert partial.stats.skipped_no_reward == 1 and partial.stats.imported == 1


LANGCHAIN_HANDLER = """
    from langchain_openai import ChatOpenAI
    from langfuse import get_client
    from langfuse.langchain import CallbackHandler
    langfuse = get_client()
    llm = ChatOpenAI(model="gpt-prod", base_url="{model}", api_key="x", max_retries=0)
    for i in range(2):
        with langfuse.start_as_current_observation(as_type="span", name="chain-agent") as span:
            llm.invoke([("system", "Be brief."), ("user", f"hello {{i}}")], config={{"callbacks": [CallbackHandler()]}})
            langfuse.create_score(name="reward", value=float(i), trace_id=span.trace_id)
    langfuse.flush()
"""


def test_langchain_callback_handler_traces_import_without_ids(langfuse: LangfuseAPIServer) -> None:
    _foreign_traffic(langfuse, LANGCHAIN_HANDLER, ["Hi zero", "Hi one"])
    assert langfuse.wait_for(2, scores=2)
    imported = import_trajectories(
        langfuse.public_key, langfuse.secret_key, langfuse.base_url, progress=False
    )
    trajectories = sorted(imported, key=lambda t: t.reward)
    assert [t.reward for t in trajectories] == [0.0, 1.0]
    for i, trajectory in enumerate(trajectories):
        assert trajectory.metadata["trace_source"] == "langchain"
        assert trajectory.metadata["sampled_token_ids"] is False
        assert trajectory.messages() == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"hello {i}"},
            {"role": "assistant", "content": f"Hi {['zero', 'one'][i]}"},
        ]


def test_a_4k_token_call_record_is_compact() -> None:
    call = LLMCall(
        request={"model": "m", "messages": [{"role": "user", "content": "x" * 100}], "temperature": 1.0},
        response={
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "y"}, "finish_reason": "stop"}
            ]
        },
        prompt_token_ids=list(range(100_000, 103_000)),
        completion_token_ids=list(range(150_000, 151_000)),
        logprobs=[-(k % 97) / 8 for k in range(1000)],  # exact in float32: packed 4 bytes each
    )
    record = pack_call(call, 0)
    # 4 bytes per id and per float32 logprob, base64: 16/3 characters each, and little else
    assert len(record) < (3000 + 1000 + 1000) * 16 / 3 + 600
