"""LangfuseExporter against the real langfuse SDK and a fake Langfuse server (tests/langfuse_receiver.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import httpx
import pytest

pytest.importorskip("langfuse")
pytest.importorskip("opentelemetry.proto")

from art_adapters.tracing.langfuse import LangfuseExporter  # noqa: E402
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup  # noqa: E402
from langfuse_receiver import LangfuseReceiver, attr_json  # noqa: E402

OTYPE = "langfuse.observation.type"


def key() -> str:
    """A fresh public key per test: the SDK keeps one client (and its URL) per key for the whole process."""
    return f"pk-test-{uuid.uuid4().hex[:12]}"


def tool_trajectory(t0: float, reward: float, answer: str = "It is 4") -> Trajectory:
    """Two captured calls: a tool call `add`, its result, then the final answer (as the capture records them)."""
    tc = {
        "id": f"call_{uuid.uuid4().hex[:6]}",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'},
    }
    user = {"role": "user", "content": "What is 2+2?"}
    system = {"role": "system", "content": "Use tools."}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    first = LLMCall(
        request={
            "model": "agent-1",
            "messages": [system, user],
            "tools": tools,
            "temperature": 1.0,
            "max_tokens": 64,
        },
        response={
            "model": "agent-1",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {"role": "assistant", "content": None, "tool_calls": [tc]},
                }
            ],
            "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
        },
        status_code=200,
        prompt_token_ids=list(range(21)),
        completion_token_ids=list(range(9)),
        logprobs=[-0.1] * 9,
        started_at=t0 + 0.010,
        latency_s=0.250,
    )
    assistant = {"role": "assistant", "tool_calls": [tc]}
    tool_msg = {"role": "tool", "tool_call_id": tc["id"], "content": "4"}
    second = LLMCall(
        request={"model": "agent-1", "messages": [system, user, assistant, tool_msg], "tools": tools},
        response={
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44},
        },
        status_code=200,
        started_at=t0 + 0.400,
        latency_s=0.125,
    )
    return Trajectory(
        messages_and_choices=[system, user, assistant, tool_msg, {"role": "assistant", "content": answer}],
        tools=tools,
        llm_calls=[first, second],
        reward=reward,
        metrics={"correct": reward > 0.5, "turns": 2},
        metadata={"scenario_id": "s-1"},
        start_time=t0,
        end_time=t0 + 0.6,
    )


@pytest.fixture
def receiver():
    with LangfuseReceiver("ok") as r:
        yield r


def roots_by_trace(r: LangfuseReceiver) -> dict[str, dict[str, Any]]:
    return {s["trace_id"]: s for s in r.spans if s["attributes"].get(OTYPE) == "agent"}


def test_import_is_lazy():
    code = "import sys, art_adapters.tracing; assert 'langfuse' not in sys.modules and 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_trace_per_trajectory_with_real_times_models_tools_scores(receiver):
    t0 = time.time() - 30
    groups = [
        TrajectoryGroup([tool_trajectory(t0 + g, reward=g + i * 0.25) for i in range(2)]) for g in range(2)
    ]
    exporter = LangfuseExporter(key(), "sk-test", receiver.base_url, session_id="run-42", project="demo")
    started = time.perf_counter()
    ids = exporter.export(groups, step=3, split="train")
    assert time.perf_counter() - started < 0.1
    assert exporter.flush(10)
    assert receiver.wait_for(lambda r: len(r.scores) >= 4 * 3)
    exporter.close()

    assert len(ids) == 4 and len(set(ids)) == 4
    assert set(receiver.traces()) == set(ids)
    for n, trace_id in enumerate(ids):
        g, i = divmod(n, 2)
        trajectory = groups[g].trajectories[i]
        spans = receiver.traces()[trace_id]
        (root,) = [s for s in spans if s["attributes"].get(OTYPE) == "agent"]
        gens = sorted(receiver.observations(trace_id, "generation"), key=lambda s: s["start_ns"])
        (tool,) = receiver.observations(trace_id, "tool")
        assert len(spans) == 4
        a = root["attributes"]
        assert a["langfuse.internal.as_root"] is True
        assert all(s["parent_span_id"] == root["span_id"] for s in gens + [tool])
        assert a["session.id"] == "run-42"
        assert a["langfuse.trace.tags"] == ["train", "step:3"]
        assert json.loads(a["langfuse.trace.metadata.group_index"]) == str(g)
        assert json.loads(a["langfuse.trace.metadata.step"]) == "3"
        assert json.loads(a["langfuse.trace.metadata.project"]) == "demo"
        assert attr_json(root, "langfuse.observation.input")["scenario"] == "What is 2+2?"
        assert attr_json(root, "langfuse.observation.output") == {"role": "assistant", "content": "It is 4"}
        assert root["start_ns"] == pytest.approx(trajectory.start_time * 1e9, abs=1e3)
        assert root["end_ns"] == pytest.approx(trajectory.end_time * 1e9, abs=1e3)
        for gen, call in zip(gens, trajectory.llm_calls, strict=True):
            assert gen["start_ns"] == pytest.approx(call.started_at * 1e9, abs=1e3)
            assert gen["end_ns"] == pytest.approx(call.ended_at * 1e9, abs=1e3)
            assert gen["attributes"]["langfuse.observation.model.name"] == "agent-1@3"
            assert attr_json(gen, "langfuse.observation.input") == call.request["messages"]
            usage = call.response["usage"]
            assert attr_json(gen, "langfuse.observation.usage_details") == {
                "input": usage["prompt_tokens"],
                "output": usage["completion_tokens"],
                "total": usage["total_tokens"],
            }
        assert (
            json.loads(gens[0]["attributes"]["langfuse.observation.metadata.finish_reason"]) == "tool_calls"
        )
        assert json.loads(gens[0]["attributes"]["langfuse.observation.metadata.completion_tokens"]) == 9
        assert attr_json(gens[0], "langfuse.observation.model.parameters")["temperature"] == 1.0
        assert attr_json(gens[1], "langfuse.observation.output")["content"] == "It is 4"
        assert tool["name"] == "add"
        assert attr_json(tool, "langfuse.observation.input") == {"a": 2, "b": 2}
        assert tool["attributes"]["langfuse.observation.output"] == "4"
        assert tool["start_ns"] == gens[0]["end_ns"] and tool["end_ns"] == gens[1]["start_ns"]
        assert receiver.scores_of(trace_id) == {
            "reward": trajectory.reward,
            "correct": float(trajectory.reward > 0.5),
            "turns": 2.0,
        }
    assert all(q[2].get("authorization", "").startswith("Basic ") for q in receiver.requests)


def test_after_each_hook_returns_group_and_numbers_groups(receiver):
    exporter = LangfuseExporter(key(), "sk", receiver.base_url)
    exporter.step, exporter.split = 7, "val"
    groups = [TrajectoryGroup([tool_trajectory(time.time(), 1.0)]) for _ in range(3)]
    assert [exporter.after_each(g) for g in groups] == groups
    assert exporter.flush(10)
    exporter.close()
    roots = roots_by_trace(receiver).values()
    assert sorted(json.loads(r["attributes"]["langfuse.trace.metadata.group_index"]) for r in roots) == [
        "0",
        "1",
        "2",
    ]
    assert all(r["attributes"]["langfuse.trace.tags"] == ["val", "step:7"] for r in roots)


def test_failed_call_and_bare_trajectory_export(receiver):
    t0 = time.time()
    failed = LLMCall(
        request={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        error="ReadTimeout",
        started_at=t0,
    )
    bare = Trajectory(messages_and_choices=[{"role": "user", "content": "hello"}], reward=float("nan"))
    exporter = LangfuseExporter(key(), "sk", receiver.base_url, skip_generations=False)
    ids = exporter.export([Trajectory(llm_calls=[failed], reward=0.0).finish(), bare])
    assert exporter.flush(10)
    exporter.close()
    (gen,) = receiver.observations(ids[0], "generation")
    assert gen["attributes"]["langfuse.observation.level"] == "ERROR"
    assert gen["attributes"]["langfuse.observation.status_message"] == "ReadTimeout"
    assert len(receiver.traces()[ids[1]]) == 1 and "reward" not in receiver.scores_of(ids[1])
    assert exporter.failed == 0 and exporter.exported == 2


def test_skip_generations_true_sends_no_generations(receiver):
    exporter = LangfuseExporter(key(), "sk", receiver.base_url, skip_generations=True)
    (trace_id,) = exporter.export(tool_trajectory(time.time(), 1.0))
    assert exporter.flush(10)
    exporter.close()
    assert receiver.observations(trace_id, "generation") == []
    assert len(receiver.observations(trace_id, "tool")) == 1 and exporter.skipped_generations == 2


def test_no_keys_means_disabled_not_broken(monkeypatch):
    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("LANGFUSE_SECRET_KEY", raising=False)
    with pytest.warns(RuntimeWarning, match="disabled"):
        exporter = LangfuseExporter()
    assert exporter.export(tool_trajectory(time.time(), 1.0)) == []
    assert exporter.flush() is True
    exporter.close()


def test_full_queue_drops_with_warning(receiver):
    exporter = LangfuseExporter(key(), "sk", receiver.base_url, max_queue=2)
    gate = threading.Event()
    emit = exporter._emit
    exporter._emit = lambda plan: (gate.wait(10), emit(plan))  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="queue full"):
        started = time.perf_counter()
        ids = exporter.export([tool_trajectory(time.time(), 1.0) for _ in range(10)])
        assert time.perf_counter() - started < 0.1
    assert len(ids) <= 3 and exporter.dropped == 10 - len(ids)
    gate.set()
    assert exporter.flush(10)
    exporter.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode", ["down", "hang", "error500"])
def test_dead_hanging_or_failing_langfuse_costs_a_bounded_delay_and_a_warning(mode):
    receiver = None if mode == "down" else LangfuseReceiver(mode).start()
    url = closed_port_url() if receiver is None else receiver.base_url
    try:
        exporter = LangfuseExporter(key(), "sk", url, timeout_s=2.0)
        trajectories = [tool_trajectory(time.time(), 1.0) for _ in range(20)]
        started = time.perf_counter()
        exporter.export(trajectories, step=1)
        assert time.perf_counter() - started < 0.1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.perf_counter()
            ok = exporter.flush(2.0)
            flush_s = time.perf_counter() - started
            started = time.perf_counter()
            exporter.close(2.0)
            close_s = time.perf_counter() - started
        assert ok is False
        assert flush_s < 2.0 + 0.5 and close_s < 2.0 + 0.5
        assert any("Langfuse" in str(w.message) for w in caught)
    finally:
        if receiver is not None:
            receiver.stop()


def test_an_unreachable_langfuse_is_one_line_not_a_retry_line_per_batch():
    """Langfuse down for a whole run: one line says so; the SDK's exporter retries each batch silently."""
    code = f"""
import time
from art_adapters.trajectories import Trajectory
from art_adapters.tracing.langfuse import LangfuseExporter
exporter = LangfuseExporter("{key()}", "sk", "{closed_port_url()}", timeout_s=1.0)
for step in range(4):  # several batches, seconds apart, as steps of a run export them
    exporter.export([Trajectory(messages_and_choices=[{{"role": "user", "content": "x"}}], reward=1.0)] * 3, step=step)
    time.sleep(1.5)
exporter.flush(1.0)
exporter.close(1.0)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not answering" in lines[0], proc.stderr[-3000:]


def test_process_exit_is_bounded_when_langfuse_hangs():
    """No close(): the exporter's atexit hook bounds the SDK's own exit-time flush (timed to the last atexit hook,
    so the interpreter's own teardown of many modules does not count)."""
    with LangfuseReceiver("hang") as receiver:
        code = f"""
import atexit, time
atexit.register(lambda: print("atexit-done", time.time(), flush=True))  # registered first: runs last
from art_adapters.trajectories import Trajectory
from art_adapters.tracing.langfuse import LangfuseExporter
exporter = LangfuseExporter("{key()}", "sk", "{receiver.base_url}", timeout_s=2.0)
exporter.export([Trajectory(messages_and_choices=[{{"role": "user", "content": "x"}}], reward=1.0)] * 5)
time.sleep(0.2)
print("ready", time.time(), flush=True)
"""
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        times = dict(
            line.split() for line in proc.stdout.splitlines() if line.split()[0] in ("ready", "atexit-done")
        )
        exit_s = float(times["atexit-done"]) - float(times["ready"])
        assert exit_s < 2.0 + 0.5, f"exit hooks took {exit_s:.1f}s"


def _chat_with_handler(server_url: str, public_key: str) -> Trajectory:
    """A LangChain ChatOpenAI call with Langfuse's own CallbackHandler, recorded by our capture."""
    from langchain_openai import ChatOpenAI
    from langfuse.langchain import CallbackHandler

    from art_adapters.capture import RecordingTransport, capture

    handler = CallbackHandler(public_key=public_key)
    http = httpx.Client(transport=RecordingTransport())
    llm = ChatOpenAI(model="agent-1", base_url=server_url, api_key="x", max_retries=0, http_client=http)
    with capture() as trajectory:
        llm.invoke("Hi there", config={"callbacks": [handler]})
    return trajectory


@pytest.mark.parametrize("skip", ["auto", False])
def test_langchain_callback_handler_generations_are_not_duplicated(receiver, skip):
    from art_adapters.testing import Reply, ScriptedServer

    public_key = key()
    exporter = LangfuseExporter(public_key, "sk", receiver.base_url, skip_generations=skip)
    with ScriptedServer([Reply(content="Hello!")]) as server:
        trajectory = _chat_with_handler(server.base_url, public_key)
    assert len(trajectory.llm_calls) == 1
    trajectory.reward = 1.0
    (trace_id,) = exporter.export(trajectory, step=0)
    assert exporter.flush(10)
    exporter.close()
    generations = [s for s in receiver.spans if s["attributes"].get(OTYPE) == "generation"]
    handler_generations = [g for g in generations if not g["attributes"].get("art_adapters.exported")]
    assert len(handler_generations) == 1
    if skip == "auto":
        assert len(generations) == 1 and exporter.skipped_generations == 1
        root = roots_by_trace(receiver)[trace_id]
        linked = json.loads(root["attributes"]["langfuse.observation.metadata.langfuse_generations"])
        assert linked == [f"{handler_generations[0]['trace_id']}/{handler_generations[0]['span_id']}"]
    else:
        assert len(generations) == 2
    assert receiver.scores_of(trace_id)["reward"] == 1.0


def test_integration_roundtrip_script_against_the_fake_server(receiver, capsys):
    """integrations/langfuse/check_roundtrip.py, end to end against the receiver's GET /api/public/traces/{id}."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "integrations" / "langfuse" / "check_roundtrip.py"
    spec = importlib.util.spec_from_file_location("check_roundtrip", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--base-url", receiver.base_url, "--public-key", key(), "--secret-key", "sk", "--wait", "10"]
    assert module.main(argv) == 0, capsys.readouterr()
    assert "ok: 4 observations" in capsys.readouterr().out
    assert any(q[0] == "GET" and "/api/public/traces/" in q[1] for q in receiver.requests)


def sourced_call(t0: float, k: int, source: dict[str, Any], answer: dict[str, Any]) -> LLMCall:
    return LLMCall(
        request={"model": "agent-1", "messages": [{"role": "user", "content": f"q{k}"}]},
        response={"choices": [{"index": 0, "finish_reason": "stop", "message": answer}]},
        status_code=200,
        started_at=t0 + 0.1 * k,
        latency_s=0.05,
        source=source,  # type: ignore[arg-type]
    )


def test_generations_nest_under_their_node_and_agent_observations(receiver):
    """A LangGraph run looks like its graph (a subgraph node inside its outer node; two runs of one node apart);
    an agent used as a tool sits inside the agent that called it; tools sit beside their generation."""
    t0 = time.time() - 30
    text = {"role": "assistant", "content": "ok"}
    tool_call = {"id": "t1", "type": "function", "function": {"name": "ask_expert", "arguments": "{}"}}
    calls = [
        sourced_call(
            t0, 0, {"framework": "langgraph", "node": "planner", "checkpoint_ns": "planner:a"}, text
        ),
        sourced_call(
            t0, 1, {"framework": "langgraph", "node": "executor", "checkpoint_ns": "executor:b"}, text
        ),
        sourced_call(
            t0, 2, {"framework": "langgraph", "node": "executor", "checkpoint_ns": "executor:c"}, text
        ),
        sourced_call(
            t0,
            3,
            {"framework": "langgraph", "node": "critic", "checkpoint_ns": "review:d", "parent_run_id": "r1"},
            text,
        ),
        sourced_call(
            t0,
            4,
            {"framework": "openai_agents", "agent": "billing", "agent_path": ["billing"], "role": "biller"},
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        ),
        sourced_call(
            t0,
            5,
            {"framework": "openai_agents", "agent": "expert", "agent_path": ["billing", "expert"]},
            text,
        ),
    ]
    trajectory = Trajectory(llm_calls=calls, reward=1.0, start_time=t0, end_time=t0 + 1)
    trajectory.messages_and_choices = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "t1", "content": "4%"},
    ]
    exporter = LangfuseExporter(key(), "sk", receiver.base_url)
    (trace_id,) = exporter.export([trajectory])
    assert exporter.flush(10)
    exporter.close()
    spans = receiver.traces()[trace_id]
    by_id = {s["span_id"]: s for s in spans}

    def parent_name(span: dict[str, Any]) -> str:
        return by_id[span["parent_span_id"]]["name"]

    chains = receiver.observations(trace_id, "chain")
    assert sorted(s["name"] for s in chains) == ["critic", "executor", "executor", "planner", "review"]
    gens = sorted(receiver.observations(trace_id, "generation"), key=lambda s: s["start_ns"])
    assert [parent_name(g) for g in gens] == [
        "planner",
        "executor",
        "executor",
        "critic",
        "billing",
        "expert",
    ]
    assert len({g["parent_span_id"] for g in gens[1:3]}) == 2  # two runs of one node, two observations
    (critic,) = [s for s in chains if s["name"] == "critic"]
    assert parent_name(critic) == "review"
    agents = {s["name"]: s for s in receiver.observations(trace_id, "agent")}
    assert parent_name(agents["expert"]) == "billing" and parent_name(agents["billing"]) == "agent"
    assert json.loads(gens[4]["attributes"]["langfuse.observation.metadata.role"]) == "biller"
    assert attr_json(gens[3], "langfuse.observation.metadata.source")["checkpoint_ns"] == "review:d"
    (tool,) = receiver.observations(trace_id, "tool")
    assert parent_name(tool) == "billing"
    for box in chains + [agents["billing"], agents["expert"]]:
        inner = [s for s in spans if s["parent_span_id"] == box["span_id"]]
        assert inner and all(box["start_ns"] <= s["start_ns"] and s["end_ns"] <= box["end_ns"] for s in inner)
