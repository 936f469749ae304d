"""A missing reward is never a zero: an imported trace nothing rewarded is flagged `reward_missing` (a 0.0
placeholder), and every grouping, the store's source and the trainer skip and count it, unless the importer maps
missing to a value (`missing_reward=`). A reward given later (the store's join, a judge) clears the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.production import StoreSource, best_traces, groups_by_key
from art_adapters.tracing.otel_genai import read_otlp

REWARD_MISSING = (
    "reward_missing"  # the flag's name is the contract (art_adapters.trajectories.REWARD_MISSING)
)


def reward_missing(trajectory: art.Trajectory) -> bool:
    return trajectory.metadata.get(REWARD_MISSING) is True


def otlp_trace(trace: str, reward: float | None, content: str = "hi") -> dict[str, Any]:
    attributes: list[dict[str, Any]] = [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
        {"key": "task", "value": {"stringValue": "t"}},
    ]
    if content:
        messages = [{"role": "user", "parts": [{"type": "text", "content": content}]}]
        answer = [{"role": "assistant", "parts": [{"type": "text", "content": "ok"}]}]
        attributes += [
            {"key": "gen_ai.input.messages", "value": {"stringValue": json.dumps(messages)}},
            {"key": "gen_ai.output.messages", "value": {"stringValue": json.dumps(answer)}},
        ]
    if reward is not None:
        attributes.append({"key": "app.reward", "value": {"doubleValue": reward}})
    span = {
        "traceId": trace,
        "spanId": trace[:16],
        "name": "chat",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": "2",
        "attributes": attributes,
    }
    return {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}


def write_traces(path: Path, *traces: dict[str, Any]) -> Path:
    path.write_text("\n".join(json.dumps(t) for t in traces))
    return path


def trajectory(reward: float, missing: bool = False, task: str = "t") -> art.Trajectory:
    t = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": task}, {"role": "assistant", "content": "a"}],
        reward=reward,
        metadata={"task": task},
    )
    if missing:
        t.metadata[REWARD_MISSING] = True
    return t


def test_otlp_import_flags_a_missing_reward_maps_it_on_request_and_skips_calls_without_messages(
    tmp_path: Path,
) -> None:
    path = write_traces(
        tmp_path / "traces.jsonl",
        otlp_trace("a" * 32, 1.0),
        otlp_trace("b" * 32, None),
        otlp_trace("c" * 32, 1.0, content=""),  # calls, but no message: never a trajectory of empty calls
    )
    stats: dict[str, int] = {}
    rewarded, missing = read_otlp(path, reward="app.reward", stats=stats)
    assert (rewarded.reward, reward_missing(rewarded)) == (1.0, False)
    assert (missing.reward, reward_missing(missing)) == (0.0, True)
    assert stats == {"no_reward": 1, "no_messages": 1}
    mapped = read_otlp(path, reward="app.reward", missing_reward=0.5)
    assert [(t.reward, reward_missing(t)) for t in mapped] == [(1.0, False), (0.5, False)]
    # The flag survives JSONL (the import CLI's output) and is honoured after it.
    art.trajectories.write_jsonl(tmp_path / "out.jsonl", [rewarded, missing])
    back = art.trajectories.read_jsonl(tmp_path / "out.jsonl")
    assert [reward_missing(t) for t in back] == [False, True]


def test_groupings_skip_and_count_a_missing_reward() -> None:
    pool = [trajectory(1.0), trajectory(0.0), trajectory(0.0, missing=True), trajectory(0.0, missing=True)]
    groups, stats = groups_by_key(pool, "task")
    assert [len(g.trajectories) for g in groups] == [2] and stats.skipped_no_reward == 2
    assert all(not reward_missing(t) for g in groups for t in g.trajectories)
    # With nothing rewarded but one, the key is too small to compare: no group trains a placeholder.
    _, alone = groups_by_key([trajectory(1.0), trajectory(0.0, missing=True)], "task")
    assert alone.groups == 0 and alone.skipped_no_reward == 1 and alone.skipped_alone == 1
    best = best_traces(pool, top_fraction=None, min_reward=0.0)
    assert len(best) == 2 and not any(reward_missing(t) for t in best)


def test_assigning_a_reward_clears_the_flag() -> None:
    from art_adapters.trajectories import REWARD_MISSING as name
    from art_adapters.trajectories import reward_missing as flagged

    assert name == REWARD_MISSING
    t = trajectory(0.0, missing=True)
    assert flagged(t)
    t.reward = 0.0  # a judge that gives 0 gives a reward: a real zero
    assert not flagged(t) and REWARD_MISSING not in t.metadata


async def test_the_store_joins_a_reward_to_a_flagged_trace_and_the_source_trains_it(tmp_path: Path) -> None:
    from art_adapters.capture.live import LiveRecorder
    from art_adapters.store import open_store

    assert (art.open_store, art.LiveRecorder) == (
        open_store,
        LiveRecorder,
    )  # both import paths, as documented
    store = art.open_store(tmp_path / "traffic.db")
    for name in ("x", "y", "z"):
        store.add(
            trajectory(0.0, missing=True), name
        )  # as OTLPEndpoint(on_trajectory=store.add ...) stores it
    store.set_reward("x", 1.0)
    store.set_reward("y", 0.0)
    source = StoreSource(store, key="task", min_size=2, idle_s=0.0, poll_s=0.0)
    groups = [g async for g in source]
    assert len(groups) == 1
    assert sorted(t.reward for t in groups[0].trajectories) == [0.0, 1.0]
    assert not any(reward_missing(t) for t in groups[0].trajectories)
    assert source.stats.trajectories == 2  # z waits for its reward: never claimed as a zero


@pytest.mark.train
def test_the_trainer_skips_and_counts_a_missing_reward(caplog: pytest.LogCaptureFixture) -> None:
    from art_adapters.config import TrainConfig
    from art_adapters.tiny import tiny_model_path
    from test_trainer import make_trainer, rollouts

    trainer = make_trainer(tiny_model_path())
    groups = rollouts(trainer, group_size=3)
    for t in groups[0].trajectories[:2]:
        t.metadata[REWARD_MISSING] = True  # the group keeps one: no advantage, nothing of it trains
    groups[1].trajectories[0].metadata[REWARD_MISSING] = True
    groups[1].trajectories[1].reward, groups[1].trajectories[2].reward = 0.0, 1.0
    groups[1].trajectories[1].metadata[REWARD_MISSING] = False  # only True means missing
    sequences, metrics = trainer.prepare(groups, TrainConfig())
    assert metrics["skipped_reward_missing"] == 3 and metrics["skipped_trajectories"] >= 3
    assert metrics["trajectories"] == 9
    assert {s.group_index for s in sequences} == {1, 2, 3}
    assert sorted(s.advantage for s in sequences if s.group_index == 1) == pytest.approx(
        [-1.0, 1.0], abs=1e-3
    )
    assert len(groups[0].trajectories) == 3  # the caller's groups are left as given
    assert sum("reward missing" in r.getMessage() for r in caplog.records) == 1  # one warning per step
    for group in groups:
        for t in group.trajectories:
            t.metadata[REWARD_MISSING] = True
    metrics = trainer.train_step(groups, TrainConfig())
    assert metrics["trained_tokens"] == 0 and "reward missing" in metrics["skipped_reason"]
    assert metrics["step"] == 1


def test_logged_reward_metrics_leave_a_missing_reward_out() -> None:
    from art_adapters.model_log import rollout_metrics

    group = art.TrajectoryGroup([trajectory(1.0), trajectory(0.5), trajectory(0.0, missing=True)])
    metrics = rollout_metrics([group])
    assert metrics["reward_mean"] == pytest.approx(0.75) and metrics["reward_missing"] == 1.0
    assert metrics["trajectories"] == 3.0


def test_the_import_command_counts_missing_rewards_and_traces_without_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from art_adapters.tracing.import_cli import import_command

    path = write_traces(
        tmp_path / "traces.jsonl",
        otlp_trace("a" * 32, 1.0),
        otlp_trace("b" * 32, None),
        otlp_trace("c" * 32, None, content=""),
    )
    out = tmp_path / "out.jsonl"
    assert import_command(["--out", str(out), "--otlp", str(path), "--reward", "app.reward"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["imported"] == 2 and counts["reward_missing"] == 1 and counts["skipped_no_messages"] == 1
    assert [reward_missing(t) for t in art.trajectories.read_jsonl(out)] == [False, True]


def test_a_missing_reward_exported_to_langfuse_comes_back_missing() -> None:
    """Our exporter writes no reward score for a placeholder; the import then skips (counts) or maps it."""
    pytest.importorskip("langfuse")
    import time

    from art_adapters.testing.langfuse_api import LangfuseAPIServer
    from art_adapters.tracing.langfuse import import_trajectories
    from test_langfuse_import import export, keys, rich_trajectory

    public, secret = keys()
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        flagged = rich_trajectory(time.time() - 60, reward=0.0)
        flagged.metadata[REWARD_MISSING] = True
        export(server, art.TrajectoryGroup([flagged, rich_trajectory(time.time() - 30, reward=1.0)]))
        assert server.wait_for(2, scores=1)

        def read(**kwargs: Any) -> Any:
            return import_trajectories(public, secret, server.base_url, progress=False, **kwargs)

        skipped = read()
        assert [t.reward for t in skipped.to_list()] == [1.0]
        assert skipped.stats.skipped_no_reward == 1
        mapped = sorted(read(missing_reward=0.25).to_list(), key=lambda t: t.reward)
        assert [(t.reward, reward_missing(t)) for t in mapped] == [(0.25, False), (1.0, False)]
