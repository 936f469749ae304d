"""The three ways' building blocks without a model: replay scenarios and their fixture tools, grouping by key with
what it skips counted, the best traces for SFT; and `art-adapters import` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from art_adapters.production import best_traces, groups_by_key, replay_scenarios
from art_adapters.trajectories import LLMCall, Trajectory, read_jsonl
from test_langfuse import tool_trajectory


def test_replay_scenarios_answer_tools_from_the_recording() -> None:
    t0 = time.time()
    scenarios = replay_scenarios([tool_trajectory(t0, 0.2, "It is 4"), tool_trajectory(t0, 0.9, "Four")])
    (scenario,) = scenarios  # the same start twice: one scenario, the better trace's answer kept
    assert [m["role"] for m in scenario.messages] == ["system", "user"]
    assert scenario.recorded_answer == "Four" and scenario.recorded_reward == 0.9
    assert scenario.tools and scenario.tools[0]["function"]["name"] == "add"
    assert scenario.tool_result("add", '{"b": 2, "a": 2}') == "4"  # argument order does not matter
    assert scenario.tool_result("add", {"a": 2, "b": 3}).startswith("error: no recorded result")
    assert len(replay_scenarios([tool_trajectory(t0, 0.2)] * 2, unique=False)) == 2


def traj(prompt: str, reward: float, version: int | None) -> Trajectory:
    call = LLMCall(request={"messages": [{"role": "user", "content": prompt}]}, policy_version=version)
    return Trajectory(
        messages_and_choices=[{"role": "user", "content": prompt}], llm_calls=[call], reward=reward
    )


def test_groups_by_key_skip_and_count() -> None:
    trajectories = [
        traj("a", 1.0, 9),
        traj("a", 0.0, 10),
        traj("a", 0.5, 10),  # a group of 3
        traj("b", 1.0, 2),
        traj("b", 0.0, 3),  # too old at step 10 with max_staleness 4
        traj("c", 1.0, 10),  # alone
        traj("d", float("nan"), 10),  # no reward
    ]
    trajectories.append(Trajectory(reward=1.0))  # no user turn: no key
    groups, stats = groups_by_key(trajectories, "prompt", current_step=10, max_staleness=4)
    assert [len(g) for g in groups] == [3] and groups[0].metadata["key"] == "a"
    assert (stats.skipped_stale, stats.skipped_alone, stats.skipped_no_reward, stats.skipped_unkeyed) == (
        2,
        1,
        1,
        1,
    )
    groups, _ = groups_by_key(trajectories[:3], "prompt", max_size=2)
    assert [len(g) for g in groups] == [2]  # the third is alone in its chunk
    best = best_traces(trajectories, top_fraction=0.5, key="prompt")
    assert sorted((t.messages()[0]["content"], t.reward) for t in best if t.messages()) == [
        ("a", 0.5),
        ("a", 1.0),
        ("b", 1.0),
        ("c", 1.0),
    ]
    assert [t.reward for t in best_traces(trajectories, top_fraction=None, min_reward=0.9)] == [
        1.0,
        1.0,
        1.0,
        1.0,
    ]


def test_art_adapters_import_command(tmp_path: Path) -> None:
    pytest.importorskip("langfuse")
    from art_adapters.testing.langfuse_api import LangfuseAPIServer
    from art_adapters.tracing.langfuse import LangfuseExporter

    public = f"pk-lf-{uuid.uuid4().hex[:8]}"
    with LangfuseAPIServer(public, "sk-lf-1") as server:
        exporter = LangfuseExporter(public, "sk-lf-1", server.base_url, tags=["prod"])
        exporter.export([tool_trajectory(time.time() - 5, r) for r in (0.25, 0.75)], step=1)
        assert exporter.flush(20)
        exporter.close()
        assert server.wait_for(2, scores=6)
        out = tmp_path / "traces.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "art_adapters.cli",
                "import",
                "--out",
                str(out),
                "--tag",
                "prod",
                "--min-score",
                "reward=0.5",
                "--base-url",
                server.base_url,
                "--public-key",
                public,
                "--secret-key",
                "sk-lf-1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["imported"] == 1 and summary["skipped_by_score"] == 1
    (trajectory,) = read_jsonl(out)
    assert trajectory.reward == 0.75 and trajectory.llm_calls[0].prompt_token_ids == list(range(21))
    spans = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "ab" * 16,
                                "spanId": "cd" * 8,
                                "name": "chat",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [
                                    {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                                    {
                                        "key": "gen_ai.input.messages",
                                        "value": {
                                            "stringValue": json.dumps(
                                                [
                                                    {
                                                        "role": "user",
                                                        "parts": [{"type": "text", "content": "hi"}],
                                                    }
                                                ]
                                            )
                                        },
                                    },
                                    {"key": "score", "value": {"doubleValue": 0.5}},
                                ],
                            }
                        ]
                    }
                ]
            }
        ]
    }
    (tmp_path / "otlp.json").write_text(json.dumps(spans))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "art_adapters.cli",
            "import",
            "--out",
            str(tmp_path / "o.jsonl"),
            "--otlp",
            str(tmp_path / "otlp.json"),
            "--reward",
            "score",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (trajectory,) = read_jsonl(tmp_path / "o.jsonl")
    assert trajectory.reward == 0.5 and trajectory.metadata["trace_source"] == "otel_genai"
