"""Credit per turn: per-call rewards, the "turn" and "gigpo" estimators (exact properties, the length-bias check of
verl RFC #7244), and how they reach each trained token through prepare_groups."""

from __future__ import annotations

import json
import math
import random

import pytest

import art_adapters as art
from art_adapters.config import TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.loss import RewardError, group_advantages
from art_adapters.training.prepare import prepare_groups
from art_adapters.training.turn_credit import (
    group_credit,
    returns_to_go,
    total_reward,
    turn_advantages,
)
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup


def call(prompt: list[int], completion: list[int], reward: float | None = None, **kwargs: object) -> LLMCall:
    return LLMCall(
        request={"messages": [{"role": "user", "content": "go"}]},
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-1.0] * len(completion),
        reward=reward,
        **kwargs,  # type: ignore[arg-type]
    )


def chain(
    turns: int, *, rewards: list[float | None] | None = None, reward: float = 0.0, start: int = 10
) -> Trajectory:
    """A trajectory of `turns` chained calls (each prompt extends the previous prompt + answer)."""
    calls, prompt = [], [1, 2, 3]
    for t in range(turns):
        completion = [start + t, 5]
        calls.append(call(list(prompt), completion, (rewards or [None] * turns)[t]))
        prompt = [*prompt, *completion, 7, 8]
    return Trajectory(llm_calls=calls, reward=reward)


def credit(trajectories: list[Trajectory], **config: object) -> list[list[float]]:
    out = group_credit(trajectories, TrainConfig(**config))  # type: ignore[arg-type]
    assert out is not None
    return out.calls


# ---- exact properties -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rewards", [True, False])
def test_turn_with_gamma_1_and_rewards_only_at_the_end_is_grpo_exactly(scale_rewards: bool) -> None:
    rewards = [1.0, 0.0, 0.25, 0.7, 0.0]
    lengths = [3, 1, 5, 2, 4]  # unequal lengths: the baseline still holds one term per trajectory
    grpo = group_advantages(rewards, scale_rewards=scale_rewards)
    assert grpo is not None
    as_trajectory_reward = [chain(n, reward=r) for n, r in zip(lengths, rewards, strict=True)]
    as_last_call_reward = [
        chain(n, rewards=[None] * (n - 1) + [r]) for n, r in zip(lengths, rewards, strict=True)
    ]
    for trajectories in (as_trajectory_reward, as_last_call_reward):
        for t, row in enumerate(credit(trajectories, advantage="turn", scale_rewards=scale_rewards)):
            assert row == [grpo[t]] * lengths[t]  # ==, not approx: the same floats


def test_constant_per_turn_rewards_equal_to_the_trajectory_reward_reproduce_trajectory() -> None:
    """Each call rewarded with what the trajectory earned (no trajectory reward) and gamma=0 (a turn is credited
    with its own reward): every call gets the "trajectory" advantage of the trajectory-rewarded group, exactly."""
    rewards, lengths = [0.9, 0.1, 0.5, 0.5, 0.0], [2, 4, 1, 3, 3]
    grpo = group_advantages(rewards)
    assert grpo is not None
    per_turn = [chain(n, rewards=[r] * n) for n, r in zip(lengths, rewards, strict=True)]
    rows = credit(per_turn, advantage="turn", gamma=0.0)
    assert rows == [[grpo[i]] * n for i, n in enumerate(lengths)]
    # GiGPO with no step weight is "trajectory" on the total reward (reward + the calls' rewards)
    totals = [total_reward(t) for t in per_turn]
    assert totals == [r * n for r, n in zip(rewards, lengths, strict=True)]
    episode = group_advantages(totals)
    assert episode is not None
    assert credit(per_turn, advantage="gigpo", gigpo_weight=0.0) == [
        [episode[i]] * n for i, n in enumerate(lengths)
    ]


def test_total_reward_is_the_trajectory_reward_when_no_call_has_one() -> None:
    trajectory = chain(3, reward=0.1 + 0.2)
    assert total_reward(trajectory) == trajectory.reward == 0.1 + 0.2  # not re-added: bit for bit
    trajectory.llm_calls[1].reward = 0.5
    assert total_reward(trajectory) == pytest.approx(0.8)


def test_returns_to_go_discount_and_terminal_reward() -> None:
    assert returns_to_go([1.0, 0.0, 2.0], 3.0, 0.5) == [1.0 + 0.5 * (0.0 + 0.5 * 5.0), 2.5, 5.0]
    assert returns_to_go([], 1.0, 0.9) == []


def _naive_per_turn_index(returns_rewards: list[list[float]]) -> list[list[float]]:
    """MT-GRPO's per-turn-index normalisation summed over the remaining turns (the construction verl RFC #7244
    shows to be biased): A_t = sum_{k >= t} (r_k - mean of r_k over the trajectories that reached turn k)."""
    longest = max(len(r) for r in returns_rewards)
    means = []
    for k in range(longest):
        reached = [r[k] for r in returns_rewards if len(r) > k]
        means.append(sum(reached) / len(reached))
    return [[sum(r[k] - means[k] for k in range(t, len(r))) for t in range(len(r))] for r in returns_rewards]


def test_turn_advantage_has_no_length_bias_where_per_turn_index_normalisation_has() -> None:
    """RFC #7244's case: every extra turn earns an intermediate reward c, and the outcome takes it back (R = -c(L-1)
    + noise), so how long a trajectory runs changes nothing in expectation. An unbiased estimator's expected
    advantage at each turn is then the same whatever the trajectory's length; the naive one's is not."""
    rng = random.Random(7244)
    c, group_size, groups = 1.0, 8, 3000
    by_length: dict[int, list[float]] = {}
    naive_by_length: dict[int, list[float]] = {}
    for _ in range(groups):
        lengths = [rng.randint(1, 4) for _ in range(group_size)]
        trajectories = []
        for n in lengths:
            outcome = -c * (n - 1) + rng.gauss(0.0, 1.0)
            trajectories.append(chain(n, rewards=[c] * (n - 1) + [None], reward=outcome))
        rows = credit(trajectories, advantage="turn", scale_rewards=False)
        naive = _naive_per_turn_index(
            [[c] * (n - 1) + [t.reward] for n, t in zip(lengths, trajectories, strict=True)]
        )
        for n, row, naive_row in zip(lengths, rows, naive, strict=True):
            by_length.setdefault(n, []).append(row[0])
            naive_by_length.setdefault(n, []).append(naive_row[0])

    def spread(values: dict[int, list[float]]) -> float:
        means = [sum(v) / len(v) for v in values.values()]
        return max(means) - min(means)

    # standard error of each mean ~ 1/sqrt(6000) ~ 0.013: 0.08 is over 4 of them apart
    assert spread(by_length) < 0.08, {n: sum(v) / len(v) for n, v in by_length.items()}
    assert spread(naive_by_length) > 1.0  # the check can fail: the biased estimator is caught


def test_gigpo_groups_only_calls_with_identical_prompt_ids() -> None:
    same, longer, other = [1, 2, 3], [1, 2, 3, 4], [1, 2, 9]
    trajectories = [
        Trajectory(llm_calls=[call(same, [5], 1.0), call([*same, 5, 6], [7])]),
        Trajectory(llm_calls=[call(same, [6], 0.0), call([*same, 6, 6], [7])]),
        Trajectory(llm_calls=[call(longer, [5], 1.0)]),  # a prefix match is not the same state
        Trajectory(llm_calls=[call(other, [5], 0.0)]),
    ]
    rows = credit(trajectories, advantage="gigpo", gigpo_weight=1.0)
    without_steps = credit(trajectories, advantage="gigpo", gigpo_weight=0.0)
    steps = [[a - b for a, b in zip(r, w, strict=True)] for r, w in zip(rows, without_steps, strict=True)]
    assert steps[0][0] == pytest.approx(1.0) and steps[1][0] == pytest.approx(-1.0)  # the one shared state
    assert steps[0][1] == steps[1][1] == steps[2][0] == steps[3][0] == 0.0  # states seen once: no step term
    # a user's state key: every first call is the same state "start" (later calls: no state)
    keyed = credit(
        trajectories,
        advantage="gigpo",
        state_key=lambda c: "start" if c.prompt_token_ids[-1] in (3, 4, 9) else None,
    )
    keyed_steps = [
        [a - b for a, b in zip(r, w, strict=True)] for r, w in zip(keyed, without_steps, strict=True)
    ]
    assert [row[0] for row in keyed_steps] == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert keyed_steps[0][1] == keyed_steps[1][1] == 0.0


def test_a_trajectory_without_calls_gets_no_advantage_and_is_counted() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    group = TrajectoryGroup([chain(2, reward=1.0), chain(3, reward=0.0), Trajectory(reward=0.5)])
    out = group_credit(group.trajectories, TrainConfig(advantage="turn"))
    assert out is not None and out.no_calls == [False, False, True] and out.calls[2] == []
    sequences, metrics = prepare_groups(
        tokenizer, len(tokenizer), [group], TrainConfig(advantage="turn"), max_seq_len=4096
    )
    assert metrics["skipped_no_calls"] == 1 and metrics["skipped_trajectories"] == 1
    assert {s.trajectory_index for s in sequences} == {0, 1}
    # every trained token carries its own call's advantage
    rows = credit(group.trajectories, advantage="turn", gamma=0.5)
    sequences, _ = prepare_groups(
        tokenizer, len(tokenizer), [group], TrainConfig(advantage="turn", gamma=0.5), max_seq_len=4096
    )
    for sequence in sequences:
        trained = [p for p, m in enumerate(sequence.trained_mask) if m]
        assert trained
        for p in trained:
            call_index = sequence.calls[p]
            assert call_index is not None
            assert sequence.advantage_at(p) == rows[sequence.trajectory_index][call_index]


def test_turn_credit_composes_with_per_role_rewards() -> None:
    planner, worker = art.CallSource(role="planner"), art.CallSource(role="worker")
    trajectories = []
    for reward, planner_reward in ((1.0, 0.0), (0.0, 1.0), (0.5, 0.5)):
        calls = [call([1, 2], [3], source=planner), call([1, 2, 3, 4], [5], source=worker)]
        trajectories.append(
            Trajectory(llm_calls=calls, reward=reward, rewards_by_role={"planner": planner_reward})
        )
    rows = credit(trajectories, advantage="turn")
    planner_only = credit(
        [Trajectory(llm_calls=t.llm_calls, reward=t.rewards_by_role["planner"]) for t in trajectories],
        advantage="turn",
    )
    overall = credit(
        [Trajectory(llm_calls=t.llm_calls, reward=t.reward) for t in trajectories], advantage="turn"
    )
    assert [r[0] for r in rows] == [r[0] for r in planner_only]  # the planner's calls: its role's reward
    assert [r[1] for r in rows] == [r[1] for r in overall]  # the worker's: the trajectory's


def test_trajectory_estimator_trains_on_reward_plus_call_rewards() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    group = TrajectoryGroup([chain(2, rewards=[1.0, None]), chain(2, rewards=[None, 0.0])])
    sequences, metrics = prepare_groups(tokenizer, len(tokenizer), [group], TrainConfig(), max_seq_len=4096)
    assert metrics["skipped_groups"] == 0  # the call rewards are the only signal, and it is trained
    assert sorted(s.advantage for s in sequences) == [-1.0, 1.0]
    assert all(not s.call_advantages for s in sequences)


# ---- bad input ----------------------------------------------------------------------------------------------


def test_bad_call_rewards_are_refused() -> None:
    trajectory = chain(2)
    for bad in (math.nan, math.inf, -math.inf, "1", True, 10**400):
        with pytest.raises(ValueError, match="finite"):
            trajectory.llm_calls[0].reward = bad  # type: ignore[assignment]
    assert trajectory.llm_calls[0].reward is None  # nothing changed
    text = trajectory.llm_calls[0].model_dump_json().replace('"reward":null', '"reward":NaN')
    with pytest.raises(ValueError, match="finite"):
        LLMCall.model_validate_json(text)


def test_call_rewards_round_trip_through_json() -> None:
    trajectory = chain(3, rewards=[0.5, None, -1.25], reward=2.0)
    again = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert [c.reward for c in again.llm_calls] == [0.5, None, -1.25]
    assert json.loads(trajectory.model_dump_json())["llm_calls"][0]["reward"] == 0.5
    group = TrajectoryGroup([trajectory])
    assert (
        TrajectoryGroup.model_validate(group.model_dump(mode="json")).trajectories[0].llm_calls[2].reward
        == -1.25
    )


def test_reward_call_rewards_the_scope_s_calls() -> None:
    trajectory = chain(3)
    with art.capture(trajectory):
        assert art.reward_call(0.5) is trajectory.llm_calls[-1]
        art.reward_call(1, call=0)
        art.reward_call(-2.0, call=-2)
        art.reward_call(0.25, call=trajectory.llm_calls[2])
        with pytest.raises(IndexError, match="3 call"):
            art.reward_call(1.0, call=3)
        with pytest.raises(ValueError, match="finite"):
            art.reward_call(math.nan)
        with pytest.raises(ValueError, match="not one of"):
            art.reward_call(1.0, call=call([1], [2]))
        with pytest.raises(TypeError):
            art.reward_call(1.0, call="0")  # type: ignore[arg-type]
    assert [c.reward for c in trajectory.llm_calls] == [1.0, -2.0, 0.25]
    with pytest.raises(RuntimeError, match="no trajectory scope"):
        art.reward_call(1.0)
    with art.capture(Trajectory()), pytest.raises(ValueError, match="no call yet"):
        art.reward_call(1.0)


def test_estimator_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="gamma has no effect"):
        TrainConfig(gamma=0.9)
    with pytest.raises(ValueError, match="gigpo_weight"):
        TrainConfig(advantage="turn", gigpo_weight=0.5)
    with pytest.raises(ValueError):
        TrainConfig(advantage="turn", gamma=1.5)
    with pytest.raises(ValueError):
        TrainConfig(advantage="credit")  # type: ignore[arg-type]
    keyed = TrainConfig(advantage="gigpo", state_key=lambda c: None)
    with pytest.raises(ValueError, match="cannot be sent to another process"):
        keyed.model_dump(mode="json")
    wire = TrainConfig(advantage="gigpo", gamma=0.9, gigpo_weight=0.5).model_dump(mode="json")
    assert TrainConfig.model_validate(wire) == TrainConfig(advantage="gigpo", gamma=0.9, gigpo_weight=0.5)
    assert TrainConfig.model_validate(TrainConfig().model_dump(mode="json")) == TrainConfig()
    with pytest.raises(RewardError, match="finite"):
        group_credit([chain(1, reward=math.nan), chain(1)], TrainConfig(advantage="turn"))
    with pytest.raises(TypeError, match="unhashable"):
        group_credit([chain(1), chain(1)], TrainConfig(advantage="gigpo", state_key=lambda c: [1]))


def test_turn_advantages_degenerate_groups() -> None:
    assert turn_advantages([[1.0, 1.0]]) is None  # one trajectory: no baseline
    assert turn_advantages([[1.0], [1.0, 1.0]]) is None  # nothing differs
    assert turn_advantages([[], [0.0], [1.0]]) == [[], [-1.0], [1.0]]


# ---- through a real training step (PEFT on the tiny model) ------------------------------------------------------


@pytest.mark.train
def test_turn_credit_reaches_the_gradient() -> None:
    """ "turn" with gamma=1 and rewards only at the end takes the very step "trajectory" takes (bit for bit); a
    reward on the planner's call alone changes only what "turn" trains, and the step still runs with the
    off-policy weights as before."""
    import torch

    from art_adapters.config import LoRAConfig
    from art_adapters.training.trainer import Trainer
    from test_train_on import gradient, groups_of

    trainer = Trainer(tiny_model_path(), LoRAConfig(rank=8, alpha=16), engine="peft")
    rewards = [1.0, 0.0, 0.5]
    grpo = gradient(trainer, groups_of(trainer, rewards, lp_shift=0.3), TrainConfig())
    turn = gradient(trainer, groups_of(trainer, rewards, lp_shift=0.3), TrainConfig(advantage="turn"))
    assert all(torch.equal(a, b) for a, b in zip(grpo, turn, strict=True))
    groups = groups_of(trainer, rewards, lp_shift=0.3)
    for trajectory, planner in zip(groups[0].trajectories, [0.0, 1.0, 0.0], strict=True):
        trajectory.llm_calls[0].reward = planner
    credited = gradient(trainer, groups, TrainConfig(advantage="turn", gamma=0.5))
    assert not all(torch.equal(a, b) for a, b in zip(grpo, credited, strict=True))
    gigpo = gradient(trainer, groups, TrainConfig(advantage="gigpo"))
    assert not all(torch.equal(a, b) for a, b in zip(credited, gigpo, strict=True))


def test_call_rewards_reach_per_role_advantages_under_trajectory() -> None:
    from art_adapters.training.loss import role_advantages

    worker = art.CallSource(role="worker")
    trajectories = [
        Trajectory(llm_calls=[call([1], [2], r, source=worker)], reward=0.0, rewards_by_role={"worker": 0.5})
        for r in (1.0, 0.0)
    ]
    assert role_advantages(trajectories) == {"worker": [1.0, -1.0]}  # 0.5 + 1.0 vs 0.5 + 0.0
