"""A guessing game trained the way ART <= 0.5.17 scripts train: hand-built trajectories of Choices from
`model.openai_client()`, `art.gather_trajectory_groups`, then `model.train(groups, config=art.TrainConfig(...))`.

Written as an ART user writes it; porting changed only `import art` -> `import art_adapters as art` (and the base
model and sizes). The model guesses a secret digit; after each guess the game says "higher" or "lower".

python examples/art_ports/number_game.py --base-model Qwen/Qwen2.5-0.5B-Instruct --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re

import art_adapters as art
from art_adapters.local import LocalBackend
from art_adapters.utils import iterate_dataset

SYSTEM = "Guess the secret digit (0-9). Answer with one digit. After each guess you hear 'higher' or 'lower'."


async def rollout(model: art.TrainableModel, secret: int, max_turns: int = 3) -> art.Trajectory:
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Your guess?"},
        ],
        metadata={"secret": secret},
    )
    distance = 10
    for turn in range(max_turns):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=8, temperature=1.0
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        match = re.search(r"\d", choice.message.content or "")
        if match is None:
            trajectory.log(f"turn {turn}: no digit")
            break
        guess = int(match.group())
        distance = min(distance, abs(guess - secret))
        if guess == secret:
            break
        hint = "higher" if guess < secret else "lower"
        trajectory.messages_and_choices.append({"role": "user", "content": f"{hint}. Your guess?"})
    # Found it: 1; close: partial credit; fewer words break ties between equally wrong games.
    said = sum(len(m.get("content") or "") for m in trajectory.messages() if m["role"] == "assistant")
    trajectory.reward = 1.0 - distance / 10 - 0.001 * said
    trajectory.metrics["distance"] = distance
    return trajectory.finish()


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args(argv)

    model = art.TrainableModel(name="number-game-001", project="number-game", base_model=args.base_model)
    backend = LocalBackend(path=args.path)
    await model.register(backend)

    secrets = [random.Random(i).randint(0, 9) for i in range(args.groups * args.steps)]
    for batch in iterate_dataset(
        secrets, groups_per_step=args.groups, initial_step=await model.get_step(), use_tqdm=False
    ):
        if batch.step >= args.steps:
            break
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, secret) for _ in range(args.group_size))
                for secret in batch.items
            ),
            pbar_desc="gather",
            max_exceptions=0.1,
        )
        metrics = await model.train(
            groups,
            config=art.TrainConfig(learning_rate=1e-4),
            _config=art.dev.TrainConfig(epsilon=0.2, epsilon_high=0.28, ppo=True),
        )
        print(
            f"step {batch.step}: reward {metrics['reward_mean']:.3f} trained_tokens {metrics['trained_tokens']}"
        )
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
