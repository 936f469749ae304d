"""SFT on the best production traces: right when good answers exist but no reward model or environment does, or as
a warm start. Recorded token ids are trained as sampled; turns without ids (foreign traces) as the template renders.

python examples/production/sft_from_traces.py --tag prod --top 0.25
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import arguments, model_of, traces  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.production import best_traces  # noqa: E402


async def run(
    model: art.TrainableModel,
    trajectories: list[art.Trajectory],
    *,
    top: float = 0.25,
    learning_rate: float = 1e-4,
) -> dict:
    best = best_traces(trajectories, top_fraction=top, key="prompt")  # each task keeps its best
    print(f"SFT on {len(best)} of {len(trajectories)} traces")
    return await model.train_sft(best, art.SFTConfig(learning_rate=learning_rate, batch_size=len(best)))


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--top", type=float, default=0.25)
    args = parser.parse_args()
    print(await run(await model_of(args), traces(args), top=args.top))


if __name__ == "__main__":
    asyncio.run(main())
