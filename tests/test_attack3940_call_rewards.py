"""Attacks on per-call rewards (issue 40): a call reward that arrives once its trajectory has been claimed for
training, or trained, must be refused (it would be stored, answered 200 "set", and never train); the same reward
again stays idempotent. TrainConfig's credit settings changed after construction are checked where they are used."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_adapters.config import TrainConfig
from art_adapters.store import RewardConflict, open_store
from art_adapters.training.turn_credit import group_credit
from art_adapters.trajectories import LLMCall, Trajectory


def _call(k: int) -> LLMCall:
    return LLMCall(request={}, prompt_token_ids=[1, 2, k], completion_token_ids=[4], logprobs=[-1.0])


def test_a_call_reward_after_training_is_refused_not_silently_stored(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t.db")
    try:
        for k in range(2):
            store.add_call("run", _call(k))
        assert store.set_call_reward("run", 0, 0.5) == "set"
        assert store.set_reward("run", 1.0) == "set"
        # rewarded, not yet claimed: a call reward still reaches the step that claims it
        assert store.set_call_reward("run", 1, -0.5) == "set"
        ((_, claimed),) = store.claim(5)
        assert [c.reward for c in claimed.llm_calls] == [0.5, -0.5]
        # claimed: a new call reward would miss the step that holds the trajectory
        store.add_call("other", _call(0))
        store.set_reward("other", 0.0)
        store.claim(5)
        with pytest.raises(RewardConflict, match="claimed for training"):
            store.set_call_reward("other", 0, 1.0)
        store.mark_trained(["run"])
        with pytest.raises(RewardConflict, match="already has reward"):
            store.set_call_reward("run", 1, 2.0)  # a different one: a conflict, as before
        # the same reward again is still idempotent after training
        assert store.set_call_reward("run", 1, -0.5) == "unchanged"
        # nothing was stored by the refusals
        again = store.get("run")
        assert again is not None and [c.reward for c in again.llm_calls] == [0.5, -0.5]
        other = store.get("other")
        assert other is not None and [c.reward for c in other.llm_calls] == [None]
        # released (its group never filled): open to call rewards again
        store.release(["other"])
        assert store.set_call_reward("other", 0, 1.0) == "set"
    finally:
        store.close()


def test_a_call_reward_for_a_trained_call_without_one_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t.db")
    try:
        store.add_call("run", _call(0))
        store.set_reward("run", 1.0)
        store.claim(5)
        store.mark_trained(["run"])
        with pytest.raises(RewardConflict, match="already trained"):
            store.set_call_reward("run", 0, 1.0)
        trajectory = store.get("run")
        assert trajectory is not None and trajectory.llm_calls[0].reward is None
    finally:
        store.close()


def _group() -> list[Trajectory]:
    return [
        Trajectory(llm_calls=[_call(0), _call(1)], reward=1.0),
        Trajectory(llm_calls=[_call(0), _call(2)], reward=0.0),
    ]


def test_credit_settings_changed_after_construction_are_checked_when_used() -> None:
    config = TrainConfig()
    config.gamma = 0.5  # no validation on assignment: the setting would do nothing under "trajectory"
    with pytest.raises(ValueError, match="gamma has no effect"):
        group_credit(_group(), config)
    config = TrainConfig(advantage="turn")
    config.gigpo_weight = 0.3
    with pytest.raises(ValueError, match="gigpo_weight has no effect"):
        group_credit(_group(), config)
    config = TrainConfig(advantage="turn")
    config.gamma = 5.0  # out of range: returns-to-go would grow by 5x per turn
    with pytest.raises(ValueError, match="gamma"):
        group_credit(_group(), config)
    config = TrainConfig(advantage="gigpo")
    config.gigpo_weight = -1.0
    with pytest.raises(ValueError, match="gigpo_weight"):
        group_credit(_group(), config)
    # a copy with another estimator keeps settings it would ignore: refused the same way
    copied = TrainConfig(advantage="turn", gamma=0.5).model_copy(update={"advantage": "trajectory"})
    with pytest.raises(ValueError, match="gamma has no effect"):
        group_credit(_group(), copied)
    # valid settings still pass
    assert group_credit(_group(), TrainConfig()) is None
    assert group_credit(_group(), TrainConfig(advantage="turn", gamma=0.5)) is not None


def test_numpy_scalars_are_call_rewards_as_they_are_trajectory_rewards() -> None:
    """A judge's numpy score (np.float32, np.int64) is a trajectory reward; as a call reward it was refused as
    'not a finite number'. NaN ones, and numpy booleans, are still refused."""
    np = pytest.importorskip("numpy")
    assert Trajectory(reward=np.float32(0.5)).reward == 0.5
    call = _call(0)
    for value, expected in ((np.float32(0.5), 0.5), (np.int64(2), 2.0), (np.float64(-1.25), -1.25)):
        call.reward = value
        assert call.reward == expected and type(call.reward) is float
    for bad in (np.float32("nan"), np.float64("inf"), np.bool_(True)):
        with pytest.raises(ValueError, match="finite"):
            call.reward = bad
    assert call.reward == -1.25


def test_a_call_reward_a_stored_trajectory_already_carries_is_set_once(tmp_path: Path) -> None:
    """A whole trajectory stored at once (the OTLP endpoint, an import) may carry its calls' rewards; the call
    reward route then answers as for a reward it set itself: the same one "unchanged", another one a conflict
    (it silently replaced the imported reward)."""
    store = open_store(tmp_path / "t.db")
    try:
        calls = [_call(0), _call(1)]
        calls[0].reward = 0.5
        store.add(Trajectory(llm_calls=calls), "whole")
        assert store.set_call_reward("whole", 0, 0.5) == "unchanged"
        with pytest.raises(RewardConflict, match="already has reward 0.5"):
            store.set_call_reward("whole", 0, 1.0)
        assert store.set_call_reward("whole", 1, 2.0) == "set"
        whole = store.get("whole")
        assert whole is not None and [c.reward for c in whole.llm_calls] == [0.5, 2.0]
    finally:
        store.close()


def test_a_call_index_counts_calls_in_the_trajectory_s_order_by_start(tmp_path: Path) -> None:
    """Two calls of one trajectory in flight at once are recorded as they finish; `/calls/{n}` names the n-th of
    `trajectory.llm_calls` (by start time), which is what the store gives the reward to (the docs said "in the
    order its calls were recorded", the finishing order)."""
    store = open_store(tmp_path / "t.db")
    try:
        late, early = _call(1), _call(0)
        late.started_at, early.started_at = 200.0, 100.0
        store.add_call("run", late)  # finished first: recorded first
        store.add_call("run", early)
        store.set_call_reward("run", 0, 1.0)
        trajectory = store.get("run")
        assert trajectory is not None
        assert trajectory.llm_calls[0].started_at == 100.0 and trajectory.llm_calls[0].reward == 1.0
    finally:
        store.close()
