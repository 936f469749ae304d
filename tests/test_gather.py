"""gather_trajectory_groups / gather_trajectories: failure budget, after_each, order, concurrency bound."""

from __future__ import annotations

import asyncio

import pytest

import art_adapters as art
from art_adapters.gather import gather_trajectories, gather_trajectory_groups
from art_adapters.trajectories import Trajectory, TrajectoryGroup


async def rollout(reward: float, *, fail: bool = False, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise RuntimeError(f"rollout {reward} failed")
    return Trajectory(reward=reward)


def groups_with_failures(failing: set[int], size: int = 4, count: int = 3) -> list[TrajectoryGroup]:
    return [
        TrajectoryGroup(rollout(g * 10 + i, fail=(g * size + i) in failing) for i in range(size))
        for g in range(count)
    ]


async def test_groups_come_back_in_input_order() -> None:
    groups = [TrajectoryGroup(rollout(g * 10 + i, delay=0.01 * (5 - g)) for i in range(3)) for g in range(5)]
    out = await gather_trajectory_groups(groups, pbar_desc=None)
    assert [[t.reward for t in g] for g in out] == [[g * 10 + i for i in range(3)] for g in range(5)]
    assert all(g.exceptions == [] for g in out)


async def test_max_exceptions_count() -> None:
    out = await gather_trajectory_groups(groups_with_failures({1, 6}), max_exceptions=2, pbar_desc=None)
    assert [len(g) for g in out] == [3, 3, 4]
    assert out[0].exceptions[0]["type"] == "RuntimeError"
    assert out[0].exceptions[0]["message"] == "rollout 1 failed"
    assert "Traceback" in out[0].exceptions[0]["traceback"]
    with pytest.raises(RuntimeError, match="failed") as info:
        await gather_trajectory_groups(groups_with_failures({1, 6, 7}), max_exceptions=2, pbar_desc=None)
    assert any("more than max_exceptions=2" in note for note in info.value.__notes__)


async def test_max_exceptions_fraction() -> None:
    # 12 rollouts: 0.25 allows 3 failures, not 4
    out = await gather_trajectory_groups(
        groups_with_failures({0, 5, 11}), max_exceptions=0.25, pbar_desc=None
    )
    assert sum(len(g.exceptions) for g in out) == 3
    with pytest.raises(RuntimeError):
        await gather_trajectory_groups(
            groups_with_failures({0, 5, 10, 11}), max_exceptions=0.25, pbar_desc=None
        )


async def test_default_allows_no_failure_and_cancels_the_rest() -> None:
    finished: list[int] = []

    async def slow(i: int) -> Trajectory:
        await asyncio.sleep(1.0)
        finished.append(i)
        return Trajectory()

    groups = [TrajectoryGroup([rollout(0, fail=True)]), TrajectoryGroup(slow(i) for i in range(4))]
    with pytest.raises(RuntimeError):
        await gather_trajectory_groups(groups, pbar_desc=None)
    await asyncio.sleep(1.1)
    assert finished == []


async def test_non_trajectory_results_are_failures() -> None:
    async def wrong() -> str:
        return "oops"

    out = await gather_trajectory_groups(
        [TrajectoryGroup([wrong(), rollout(1)])], max_exceptions=1, pbar_desc=None
    )
    assert out[0].exceptions[0]["type"] == "RolloutError" and len(out[0]) == 1


async def test_after_each_replaces_and_drops() -> None:
    seen: list[int] = []

    async def after(group: TrajectoryGroup) -> TrajectoryGroup | None:
        first = group.trajectories[0].reward
        seen.append(int(first))
        if first == 10:
            return None
        for t in group:
            t.reward = t.reward * 2
        return TrajectoryGroup(group.trajectories, metadata={"scored": True})

    groups = [TrajectoryGroup(rollout(g * 10 + i) for i in range(2)) for g in range(3)]
    out = await gather_trajectory_groups(groups, after_each=after, pbar_desc=None)
    assert sorted(seen) == [0, 10, 20]
    assert [[t.reward for t in g] for g in out] == [[0, 2], [40, 42]]
    assert all(g.metadata == {"scored": True} for g in out)

    def sync_after(group: TrajectoryGroup) -> TrajectoryGroup:
        group.metadata["sync"] = 1
        return group

    out = await gather_trajectory_groups(
        [TrajectoryGroup([rollout(1)])], after_each=sync_after, pbar_desc=None
    )
    assert out[0].metadata == {"sync": 1}


async def test_max_concurrent_bounds_running_rollouts() -> None:
    running = 0
    peak = 0

    async def tracked(i: int) -> Trajectory:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return Trajectory(reward=i)

    groups = [TrajectoryGroup(tracked(g * 4 + i) for i in range(4)) for g in range(6)]
    out = await gather_trajectory_groups(groups, max_concurrent=3, pbar_desc=None)
    assert peak == 3 and sum(len(g) for g in out) == 24
    peak = 0
    await gather_trajectory_groups([TrajectoryGroup(tracked(i) for i in range(24))], pbar_desc=None)
    assert peak == 24


async def test_progress_bar_shows_reward_and_exceptions(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("art_adapters.progress.live_display", lambda: True)  # as in a terminal
    groups = [TrajectoryGroup([rollout(1.0), rollout(0.0), rollout(2, fail=True)])]
    await gather_trajectory_groups(groups, max_exceptions=1, pbar_desc="rollouts")
    err = capsys.readouterr().err
    assert "rollouts" in err and "3/3" in err and "reward=0.500" in err and "exceptions=1" in err


async def test_progress_bar_counts_completion_tokens_when_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pbar_total_completion_tokens=True` (ART's flag) shows the tokens generated so far, never ignored."""
    monkeypatch.setattr("art_adapters.progress.live_display", lambda: True)

    async def sampled(n: int) -> Trajectory:
        call = art.LLMCall(request={}, prompt_token_ids=[1], completion_token_ids=list(range(n)))
        usage_only = art.LLMCall(request={}, response={"usage": {"completion_tokens": 2}})
        return Trajectory(llm_calls=[call, usage_only])

    for asked, shown in ((True, "completion_tokens=16"), (False, None)):
        await gather_trajectory_groups(
            [TrajectoryGroup([sampled(5), sampled(7)])], pbar_desc="g", pbar_total_completion_tokens=asked
        )
        err = capsys.readouterr().err
        assert (shown in err) if shown else "completion_tokens" not in err
    await art.gather_trajectories([sampled(3)], pbar_desc="t", pbar_total_completion_tokens=True)
    assert "completion_tokens=5" in capsys.readouterr().err


async def test_awaitable_groups_and_gather_trajectories() -> None:
    async def make_group() -> TrajectoryGroup:
        return TrajectoryGroup([rollout(5), rollout(6)])

    out = await art.gather_trajectory_groups([make_group(), TrajectoryGroup([rollout(7)])], pbar_desc=None)
    assert [[t.reward for t in g] for g in out] == [[5, 6], [7]]

    trajectories = await gather_trajectories(
        [rollout(i, fail=i == 2, delay=0.001 * (5 - i)) for i in range(5)], max_exceptions=1, pbar_desc=None
    )
    # ART's contract: each failed rollout's exception in its place (within max_exceptions)
    assert [t.reward for t in trajectories if isinstance(t, art.Trajectory)] == [0, 1, 3, 4]
    assert isinstance(trajectories[2], RuntimeError)
    with pytest.raises(RuntimeError):
        await art.gather_trajectories([rollout(0, fail=True)], pbar_desc=None)


PROGRESS_SCRIPT = """
import asyncio
import art_adapters as art
from art_adapters.trajectories import Trajectory, TrajectoryGroup

async def rollout(r):
    return Trajectory(reward=r)

asyncio.run(art.gather_trajectory_groups([TrajectoryGroup(rollout(i) for i in range(3))], pbar_desc="gather"))
print("done")
"""


def test_progress_bar_is_live_in_a_terminal_and_absent_from_logs() -> None:
    """A terminal (a real pseudo-terminal) sees the bar; a log (a pipe) gets no redrawn bar lines."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    logged = subprocess.run(
        [sys.executable, "-c", PROGRESS_SCRIPT], capture_output=True, text=True, check=True
    )
    assert logged.stdout == "done\n"
    assert logged.stderr == ""

    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns
    with subprocess.Popen(
        [sys.executable, "-c", PROGRESS_SCRIPT], stdout=subprocess.PIPE, stderr=terminal, text=True
    ) as process:
        os.close(terminal)
        out, _ = process.communicate(timeout=120)
        shown = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal's other side closed
                break
            if not chunk:
                break
            shown += chunk
    os.close(controller)
    assert out == "done\n"
    assert b"gather: 100%" in shown and b"3/3" in shown, shown
