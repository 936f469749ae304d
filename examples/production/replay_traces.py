"""Replay: production conversations become scenarios for ordinary GRPO rollouts of the current policy, the tools'
recorded results standing in for the tools. Right when the traffic is foreign (no token ids) or too old to train on
directly, and a reward can be computed for new answers.

python examples/production/replay_traces.py --tag prod --steps 3
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import arguments, model_of, traces  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.production import ReplayScenario, replay_rollout, replay_scenarios  # noqa: E402


def longer_is_better(scenario: ReplayScenario, trajectory: art.Trajectory) -> float:
    """A stand-in reward (use your own: a judge, a checker, `production.same_answer`)."""
    answer = trajectory.messages()[-1].get("content") or ""
    return min(len(answer), 40) / 40


async def run(
    model: art.TrainableModel,
    trajectories: list[art.Trajectory],
    *,
    steps: int = 1,
    group_size: int = 4,
    max_tokens: int = 16,
    reward_fn=longer_is_better,
) -> list[dict]:
    scenarios = replay_scenarios(trajectories)
    print(f"{len(scenarios)} scenarios from {len(trajectories)} traces")
    results = []
    for _ in range(steps):
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(
                replay_rollout(model, s, reward_fn=reward_fn, max_tokens=max_tokens)
                for _ in range(group_size)
            )
            for s in scenarios
        )
        results.append(await model.train(groups, art.TrainConfig(learning_rate=1e-4)))
    return results


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(await run(await model_of(args), traces(args), steps=args.steps))


if __name__ == "__main__":
    asyncio.run(main())
