"""The sharded per-agent trainer's processes route each call by the table the backend sends (`route_table`), not
by the PerAgent rule: every call a process can train must be in it. A call held only by one of a trajectory's
`additional_histories` (a trace read back from Langfuse whose histories name calls beyond the main ones) is
trained by the one-process trainer; here the sharded step's own command (`worker.run`, as each process runs it)
trains the same step on a one-process trainer, instead of refusing every such step with a bare KeyError (an
error the processes agree on: the trainer stays up, or is reloaded when an adapter had already stepped)."""

from __future__ import annotations

from typing import Any

import pytest

import art_adapters as art
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.history import History
from art_adapters.tiny import tiny_model_path
from art_adapters.training import worker
from art_adapters.training.agent_steps import route_table
from art_adapters.training.per_agent import PerAgentTrainer
from art_adapters.trajectories import TrajectoryGroup
from test_per_agent_training import groups_of

pytestmark = pytest.mark.train
LORA = LoRAConfig(rank=4, alpha=8)
CONFIG = TrainConfig(learning_rate=1e-4, micro_batch_tokens=64)
ROLE = art.PerAgent(by="role")


def with_b_in_a_history(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Each trajectory's call by b moved from `llm_calls` into an additional history (its main calls: a's)."""
    for group in groups:
        for trajectory in group.trajectories:
            b = trajectory.llm_calls.pop(1)
            assert b.source is not None and b.source.role == "b"
            trajectory.additional_histories = [History(llm_calls=[b])]
    return groups


def test_a_call_only_in_an_additional_history_is_routed_in_the_processes() -> None:
    single = PerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, seed=3)
    groups = with_b_in_a_history(groups_of(single, ["a", "b"]))
    expected = single.train_step(groups, CONFIG)
    process = PerAgentTrainer(tiny_model_path(), LORA, per_agent=None, seed=3)  # as each process holds it
    command: dict[str, Any] = {  # what ShardedPerAgentTrainer.train_step sends
        "op": "train_step",
        "groups": [g.model_dump(mode="json") for g in groups],
        "config": CONFIG.model_dump(mode="json", exclude_unset=True),
        "routes": route_table(ROLE, groups),
    }
    answer = worker.run(process, command)
    assert process.step == single.step == 1 and process.agents == single.agents == ["a"]
    for key in ("loss", "trained_tokens", "grad_norm"):
        assert answer["metrics"][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key


def test_scratch_is_refused_where_it_would_do_nothing() -> None:
    """Only a sharded process rebuilds its model through a temporary checkpoint: one process given a folder for
    it is refused, before anything loads."""
    with pytest.raises(ValueError, match="scratch"):
        PerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, scratch="/tmp")
