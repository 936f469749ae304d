"""Train only the planner of a two-node LangGraph: `train_on={"nodes": ["planner"]}`; the executor's calls stay
context. Per-role rewards give the planner credit for plans that name the operation as well as for right answers.

python examples/langgraph_planner_executor/train.py --base-model Qwen/Qwen2.5-3B-Instruct --steps 50   # GPU recipe
python examples/langgraph_planner_executor/train.py --base-model "$(art-adapters tiny-model)" --steps 2  # CPU, tiny
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import build_graph  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.langgraph import wrap_rollout  # noqa: E402

OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def questions(seed: int, n: int) -> list[tuple[str, int, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, word = rng.randint(2, 9), rng.randint(2, 9), rng.choice(sorted(OPERATIONS))
        out.append((f"What is {a} {word} {b}?", OPERATIONS[word](a, b), word))
    return out


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-3B-Instruct")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--questions", type=int, default=2, help="questions (groups) per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args(argv)

    model = art.TrainableModel(name="planner", project="planner-executor", base_model=args.base_model)
    await model.register(art.LocalBackend(args.path))
    assert model.inference_base_url is not None
    graph = build_graph(
        model.inference_base_url,
        model.inference_api_key or "none",
        model.get_inference_name(),
        args.max_tokens,
    )

    @wrap_rollout(model)
    async def rollout(question: str, expected: int, word: str) -> art.Trajectory:
        state = await graph.ainvoke({"question": question})
        right = state["answer"].strip() == str(expected)
        trajectory = art.current_trajectory(required=True)
        assert trajectory is not None
        # The planner's own reward: the right answer, or at least a plan naming the operation (and shorter).
        named = word in state["plan"].lower()
        trajectory.rewards_by_role = {"planner": float(right) + 0.5 * named - len(state["plan"]) / 2000}
        trajectory.reward = float(right) - len(state["answer"]) / 2000  # shorter wrong answers win ties
        return trajectory

    config = art.TrainConfig(learning_rate=args.learning_rate, train_on={"nodes": ["planner"]})
    for step in range(args.steps):
        batch = questions(step, args.questions)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(*q) for _ in range(args.group_size)) for q in batch),
            pbar_desc=f"step {step}",
        )
        metrics = await model.train(groups, config=config)
        rewards = [t.reward for g in groups for t in g]
        print(
            f"step {step}: reward {sum(rewards) / len(rewards):.3f}, trained_tokens {metrics['trained_tokens']} "
            f"(planner), left_out_tokens {metrics['left_out_tokens']} (executor), "
            f"sampled_token_fraction {metrics['sampled_token_fraction']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
