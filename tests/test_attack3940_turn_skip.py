"""Attack on turn-level credit (issue 40) with `train_on` (and so per-agent adapters, whose step trains only its
agent's calls): a group whose TRAINED calls all have advantage 0 teaches nothing and must be skipped, as GRPO skips
a group of equal rewards; counting the other calls' advantages made the step train zeros (an optimizer step with
no signal, which AdamW's moments still move) and report it as trained."""

from __future__ import annotations

import art_adapters as art
from art_adapters.config import TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.prepare import prepare_groups
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

PLANNER, WORKER = art.CallSource(role="planner"), art.CallSource(role="worker")


def _call(prompt: list[int], completion: list[int], source: art.CallSource, reward: float | None) -> LLMCall:
    return LLMCall(
        request={"messages": [{"role": "user", "content": "go"}]},
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-1.0] * len(completion),
        source=source,
        reward=reward,
    )


def _trajectory(worker_reward: float) -> Trajectory:
    """The planner's call earns nothing of its own; the worker's call is rewarded (gamma=0: each turn's own)."""
    return Trajectory(
        llm_calls=[
            _call([1, 2, 3], [10, 5], PLANNER, None),
            _call([1, 2, 3, 10, 5, 7, 8], [11, 5], WORKER, worker_reward),
        ],
        reward=0.0,
    )


def test_a_group_whose_trained_calls_have_no_advantage_is_skipped() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    group = TrajectoryGroup([_trajectory(1.0), _trajectory(0.0)])
    config = TrainConfig(advantage="turn", gamma=0.0, train_on={"roles": ["planner"]})
    sequences, metrics = prepare_groups(tokenizer, len(tokenizer), [group], config, max_seq_len=4096)
    assert metrics["skipped_groups"] == 1 and sequences == []
    # the worker's calls do carry a signal, and train when chosen
    config = TrainConfig(advantage="turn", gamma=0.0, train_on={"roles": ["worker"]})
    sequences, metrics = prepare_groups(tokenizer, len(tokenizer), [group], config, max_seq_len=4096)
    assert metrics["skipped_groups"] == 0 and sequences
    trained = [s.advantage_at(p) for s in sequences for p, m in enumerate(s.trained_mask) if m]
    assert trained and all(a != 0.0 for a in trained)
    # per-agent adapters: the planner adapter's view selects its calls the same way
    sequences, metrics = prepare_groups(
        tokenizer,
        len(tokenizer),
        [group],
        TrainConfig(advantage="turn", gamma=0.0),
        max_seq_len=4096,
        select=lambda source: source is not None and source.role == "planner",
    )
    assert metrics["skipped_groups"] == 1 and sequences == []
