"""Training from production: imported traces and recorded traffic, three ways.

- SFT on the best traces: `best_traces(...)` then `model.train_sft(...)` (recorded token ids where there are any,
  the chat template's rendering otherwise).
- Replay: `replay_scenarios(...)` turns traces into scenarios (the user's turn, the tools' recorded results as a
  fixture environment) for ordinary GRPO rollouts, `replay_rollout(...)`.
- Off-policy RL on the recorded traffic itself: `groups_by_key(...)` (recorded logprobs as the behaviour policy,
  recorded versions for staleness), or `StoreSource` to train continuously from a trajectory store as rewards
  arrive (`train_async(model, source.rollout, source, on_step=source.on_step)`).
"""

from .groups import GroupStats, best_traces, groups_by_key
from .replay import ReplayScenario, replay_rollout, replay_scenarios, same_answer
from .source import StoreSource

__all__ = [
    "GroupStats",
    "ReplayScenario",
    "StoreSource",
    "best_traces",
    "groups_by_key",
    "replay_rollout",
    "replay_scenarios",
    "same_answer",
]
