"""ART's async pipeline, the way ART's own yes/no/maybe pipeline example trains: one request with `n` choices is a
group, `PipelineTrainer` keeps rollout workers sampling while the trainer steps, eval runs every few steps.

Written as an ART user writes it; porting changed only the imports (`import art_adapters as art`,
`art_adapters.pipeline_trainer`) and the backend (ART's example uses TinkerNativeBackend; here LocalBackend, on the
CPU too), plus the base model and sizes. `--warm-start N` (ours, off by default) first teaches a model that has
never seen the words to answer with one of them at random, so every group has rewards to compare (a random tiny
model never says "maybe", and a group whose rewards are all equal teaches nothing).

python examples/art_ports/yes_no_maybe_pipeline.py --base-model Qwen/Qwen3-4B-Instruct-2507 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from functools import partial
from itertools import cycle, permutations
from pathlib import Path

import art_adapters as art
from art_adapters.local import LocalBackend
from art_adapters.pipeline_trainer import PipelineTrainer


def build_scenarios() -> list[dict[str, str]]:
    """Every way of asking for one of the three words."""
    scenarios = []
    for lead in ("respond", "just respond"):
        for quoted in (True, False):
            for size in (3, 2):
                for words in permutations(["yes", "no", "maybe"], size):
                    shown = [f"'{w}'" if quoted else w for w in words]
                    listed = ", ".join(shown) if size == 3 else " or ".join(shown)
                    scenarios.append({"prompt": f"{lead} with {listed}"})
    return scenarios


def reward_for_answer(text: str) -> float:
    """maybe 1.0, no 0.75, yes 0.5, anything else 0."""
    words = re.split(r"\s+", text.strip().lower())
    first = words[0].strip(".,!?:;\"'()[]{}") if words and words[0] else ""
    return {"maybe": 1.0, "no": 0.75, "yes": 0.5}.get(first, 0.0)


async def rollout_fn(
    model: art.TrainableModel, scenario: dict[str, str], config: dict[str, int]
) -> art.TrajectoryGroup:
    """One request, `n` choices: the group."""
    messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        messages=messages, model=model.get_inference_name(), max_tokens=config["max_tokens"], n=config["n"]
    )
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*messages, choice], reward=reward_for_answer(choice.message.content or "")
        )
        for choice in response.choices
    )


async def eval_fn(
    model: art.TrainableModel, step: int, config: dict[str, int], *, scenarios: list[dict[str, str]]
) -> list[art.Trajectory]:
    trajectories = []
    client = model.openai_client()
    for scenario in scenarios:
        messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
        response = await client.chat.completions.create(
            messages=messages, model=model.get_inference_name(step), max_tokens=config["max_tokens"], n=1
        )
        choice = response.choices[0]
        trajectories.append(
            art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward=reward_for_answer(choice.message.content or ""),
            )
        )
    return trajectories


async def main(args: argparse.Namespace) -> None:
    backend = LocalBackend(path=args.path)
    model = art.TrainableModel(
        name="pipeline-yes-no-maybe", project="yes-no-maybe-pipeline", base_model=args.base_model
    )
    await model.register(backend)
    scenarios = build_scenarios()
    if args.warm_start:
        words = cycle(["yes", "no", "maybe"])
        examples = [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": s["prompt"]},
                    {"role": "assistant", "content": next(words)},
                ]
            )
            for s in (scenarios * args.warm_start)
        ]
        await model.train_sft(examples, config=art.TrainSFTConfig(learning_rate=5e-3, batch_size=16))
    trainer = PipelineTrainer(
        model=model,
        backend=backend,
        rollout_fn=rollout_fn,
        scenarios=cycle(scenarios),
        config={"n": args.rollouts_per_scenario, "max_tokens": args.max_tokens},
        learning_rate=args.learning_rate,
        loss_fn="cispo",
        eval_fn=partial(eval_fn, scenarios=scenarios[: args.eval_scenarios]),
        max_steps=args.steps,
        eval_every_n_steps=args.eval_every,
        eval_at_start=False,
        total_scenarios=None,
        pipeline=art.PipelineRuntimeConfig(  # ART main's form (its older direct keywords work too)
            num_rollout_workers=args.workers, min_batch_size=args.groups_per_step, max_steps_off_policy=1
        ),
    )
    await trainer.train()
    history = Path(args.path) / model.project / "models" / model.name / "history.jsonl"
    for line in history.read_text().splitlines():
        row = json.loads(line)
        if "train/reward" in row:
            print(
                f"step {row['step']} reward {row['train/reward']:.3f} reward_std_dev {row['train/reward_std_dev']:.3f} "
                f"steps_off_policy {row['train/steps_off_policy']:.2f} trained_tokens {int(row['train/trained_tokens'])}"
            )
    await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", default="Qwen/Qwen3-4B-Instruct-2507")
    parser.add_argument("--path", default=".art")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rollouts-per-scenario", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=5)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--eval-scenarios", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument(
        "--warm-start", type=int, default=0, help="SFT epochs of random answers first (0: none)"
    )
    asyncio.run(main(parser.parse_args()))
