"""ART's quick-start loop on art-adapters: rollouts from `model.openai_client()`, grouped, then one GRPO step each.

python examples/quickstart.py --steps 10 --base-model Qwen/Qwen2.5-0.5B-Instruct   # trains (LocalBackend)
python examples/quickstart.py --endpoint http://127.0.0.1:8000/v1 --steps 1        # rollouts only, any endpoint
"""

from __future__ import annotations

import argparse
import asyncio
import random

import art_adapters as art

SYSTEM = "You are a calculator. Reply with the number only."


def scenarios(count: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(count)]
    return [(f"What is {a} + {b}?", a + b) for a, b in pairs]


async def rollout(model: art.Model, question: str, answer: int, max_tokens: int = 16) -> art.Trajectory:
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        reward=0.0,
        metadata={"question": question},
    )
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=trajectory.messages(),
        max_tokens=max_tokens,
        temperature=1.0,
    )
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    text = (choice.message.content or "").strip()
    # Right: 1; the answer somewhere in the text: 0.2; among wrong answers, shorter ones (a number only) win.
    if text == str(answer):
        trajectory.reward = 1.0
    else:
        trajectory.reward = (0.2 if str(answer) in text else 0.0) - min(len(text), 100) / 1000
    trajectory.metrics["chars"] = len(text)
    return trajectory


async def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--base-model", default="Qwen/Qwen2.5-0.5B-Instruct", help="model to train (LocalBackend)"
    )
    parser.add_argument(
        "--endpoint", help="rollouts only, against this OpenAI-compatible base URL (no training)"
    )
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model-name", default="quickstart", help="served model name (with --endpoint)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--path", default=".art", help="LocalBackend folder")
    args = parser.parse_args(argv)

    if args.endpoint:
        model: art.Model = art.Model(
            name=args.model_name, inference_base_url=args.endpoint, inference_api_key=args.api_key
        )
    else:
        model = art.TrainableModel(name="quickstart", project="quickstart", base_model=args.base_model)
        await model.register(art.LocalBackend(args.path))

    rewards: list[float] = []
    start = await model.get_step() if isinstance(model, art.TrainableModel) else 0
    for step in range(start, start + args.steps):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, question, answer) for _ in range(args.group_size))
                for question, answer in scenarios(args.groups, seed=step)
            ),
            pbar_desc=f"step {step}",
        )
        mean = sum(t.reward for g in groups for t in g) / max(sum(len(g) for g in groups), 1)
        rewards.append(mean)
        line = f"step {step}: reward {mean:.3f}"
        if isinstance(model, art.TrainableModel):
            metrics = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
            line += f" trained_tokens {metrics['trained_tokens']}"
        print(line, flush=True)
    return rewards


if __name__ == "__main__":
    asyncio.run(main())
