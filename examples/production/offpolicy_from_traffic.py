"""Off-policy RL directly on recorded traffic: traces of the same task become a group, their recorded logprobs the
behaviour policy and their recorded version the staleness the async loss corrects. Right when our own traces
(token ids recorded) carry rewards and the policy that served them is at most a few steps old.

python examples/production/offpolicy_from_traffic.py --tag prod --max-staleness 4
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import arguments, model_of, traces  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.production import GroupStats, groups_by_key  # noqa: E402


async def run(
    model: art.TrainableModel,
    trajectories: list[art.Trajectory],
    *,
    key: str = "prompt",
    max_staleness: int = 4,
    learning_rate: float = 1e-4,
) -> tuple[dict, GroupStats]:
    step = await model.get_step()
    groups, stats = groups_by_key(trajectories, key, current_step=step, max_staleness=max_staleness)
    print(
        f"{stats.groups} groups of {stats.grouped} traces; skipped: {stats.skipped_stale} too old, "
        f"{stats.skipped_unkeyed} without a key, {stats.skipped_alone} alone"
    )
    if not groups:
        return {}, stats
    return await model.train(groups, art.TrainConfig(learning_rate=learning_rate)), stats


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--key", default="prompt", help="a metadata field, or 'prompt' (the first user turn)")
    parser.add_argument("--max-staleness", type=int, default=4)
    args = parser.parse_args()
    print(await run(await model_of(args), traces(args), key=args.key, max_staleness=args.max_staleness))


if __name__ == "__main__":
    asyncio.run(main())
