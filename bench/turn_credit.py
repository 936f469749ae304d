"""Credit per turn, measured: "trajectory" (GRPO) vs "turn" vs "gigpo" on a multi-turn tool chain with the tiny model,
the same steps, rollout seeds and warm start for every estimator, repeated over seeds; differences are paired.

The task: a support agent must call 3 tools in order (`query`, then `day`, then `capital`; each name one token of the
tiny tokenizer). A wrong call is answered "wrong tool, try again" and costs a turn, so an early mistake can be
repaired later; at most 5 turns. Every call is rewarded on its own (`art.reward_call`: 1/3 when it advances the chain,
0 otherwise) and the trajectory gets 1.0 when the chain completes (success). Tool call ids and arguments are
normalised before they go back to the model, so rollouts that made the same choices reach the same prompt token ids:
states repeat across a group, which GiGPO's step groups need. Every arm sees the same rewards ("trajectory" trains on
their sum); only the estimator differs.

Reported: mean training success per step (each step's rollouts, over seeds), the final evaluation's success, each
arm's paired difference to "trajectory" with a 95 % t-interval over seeds, and the steps each arm takes to reach the
"trajectory" arm's final success (the issue's goal: the better of turn/GiGPO within 0.7x the steps).
The warm start (192 SFT steps) teaches the multi-turn call format, calling until the chain completes or the turns
run out; each call is the right tool with p = 0.2, else one of the four at random (right 40 % of the time in all):
about 0.16 success at step 1 in a one-seed probe.
Usage: python bench/turn_credit.py [--steps 12] [--group-size 8] [--seeds 6] [--eval-samples 8] [--gamma 1.0]
       [--gigpo-weight 1.0] [--right-rate 0.2] [--warm-epochs 48] [--arms trajectory turn gigpo]
       [--json rows.json] [--seed-offset 0] | --summarize rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_pipeline import over_seeds, paired_interval  # noqa: E402 - the bench's shared helpers

CHAIN = ["query", "day", "capital"]
TOOL_DESCRIPTIONS = {
    "query": "look up an order",
    "day": "today's date",
    "fun": "a joke",
    "capital": "a capital city",
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": n, "description": d, "parameters": {"type": "object", "properties": {}}},
    }
    for n, d in TOOL_DESCRIPTIONS.items()
]
RESULTS = {"query": "order 42: shipped", "day": "Monday", "capital": "Paris", "fun": "a pun"}
WRONG = "wrong tool, try again"
MAX_TURNS = 5
SYSTEM = "You are a support agent. Call one tool per turn: query, then day, then capital."
SCENARIOS = [
    "Where is my order, and when and where will it arrive?",
    "Track order 42 for me.",
    "Has my parcel shipped? Tell me the day and the city.",
    "My package is late: status, day and city please.",
]
ARMS = ("trajectory", "turn", "gigpo")


def tool_message(turn: int, name: str) -> dict[str, Any]:
    """The assistant's call as it goes back to the model: a fixed id and no arguments (states repeat)."""
    call = {"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": "{}"}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def warm_start(count: int, seed: int, right_rate: float) -> list[Any]:
    """The multi-turn tool-call format: every example calls a tool per turn until the chain completes or the turns
    run out, the right tool with probability `right_rate` and otherwise one of the four at random (so a call is
    right with p = right_rate + (1 - right_rate) / 4): the agent starts well below the chain and RL must learn it."""
    import art_adapters as art

    rng = random.Random(seed)
    out = []
    for i in range(count):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": SCENARIOS[i % len(SCENARIOS)]},
        ]
        done = 0
        for turn in range(MAX_TURNS):
            name = CHAIN[done] if rng.random() < right_rate else rng.choice(list(TOOL_DESCRIPTIONS))
            right = name == CHAIN[done]
            done += right
            messages += [
                tool_message(turn, name),
                {
                    "role": "tool",
                    "tool_call_id": f"call_{turn}",
                    "content": RESULTS[name] if right else WRONG,
                },
            ]
            if done == len(CHAIN):
                break
        out.append(art.Trajectory(messages_and_choices=messages, tools=TOOLS, reward=1.0))
    return out


async def rollout(model: Any, request: str, seed: int) -> Any:
    """One episode: up to MAX_TURNS calls; each call rewarded by progress, the trajectory by success."""
    import art_adapters as art

    client = model.openai_client()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": request},
    ]
    done = turns = 0
    async with art.capture() as trajectory:
        for turn in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=messages,
                tools=TOOLS,
                max_tokens=24,
                temperature=1.0,
                seed=seed + turn,
            )
            turns += 1
            calls = reply.choices[0].message.tool_calls or []
            name = getattr(getattr(calls[0], "function", None), "name", None) if calls else None
            if name is None:
                art.reward_call(0.0)
                break  # no tool call: the episode ends
            right = name == CHAIN[done]
            art.reward_call(1.0 / len(CHAIN) if right else 0.0)
            done += right
            messages += [
                tool_message(turn, name),
                {
                    "role": "tool",
                    "tool_call_id": f"call_{turn}",
                    "content": RESULTS.get(name, WRONG) if right else WRONG,
                },
            ]
            if done == len(CHAIN):
                break
    success = done == len(CHAIN)
    trajectory.reward = 1.0 if success else 0.0
    trajectory.metrics.update(success=float(success), progress=done / len(CHAIN), turns=float(turns))
    return trajectory


def groups_for(model: Any, size: int, seed: int) -> list[Any]:
    import art_adapters as art

    return [
        art.TrajectoryGroup(rollout(model, request, seed + 101 * (s * size + i)) for i in range(size))
        for s, request in enumerate(SCENARIOS)
    ]


def success_of(groups: list[Any], metric: str = "success") -> float:
    return statistics.mean(t.metrics[metric] for g in groups for t in g.trajectories)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    return await over_seeds(args, run_seed, "bench-turns-")


def config_of(arm: str, args: argparse.Namespace, seed: int) -> Any:
    import art_adapters as art

    settings: dict[str, Any] = {"advantage": arm}
    if arm != "trajectory":
        settings["gamma"] = args.gamma
    if arm == "gigpo":
        settings["gigpo_weight"] = args.gigpo_weight
    return art.TrainConfig(learning_rate=args.learning_rate, seed=seed, **settings)


async def run_seed(args: argparse.Namespace, backend: Any, seed: int) -> list[dict[str, Any]]:
    """Every arm once, from the same warm start (its checkpoint and optimizer state) and on the same seeds."""
    import art_adapters as art
    from art_adapters.tiny import tiny_model_path

    lora = art.LoRAConfig(rank=16, alpha=32)
    base = str(tiny_model_path())
    models = {
        arm: art.TrainableModel(name=f"chain-{seed}-{arm}", project="bench", base_model=base, lora=lora)
        for arm in ARMS
    }
    first = models[ARMS[0]]
    await first.register(backend)
    await first.train_sft(
        warm_start(64, seed, args.right_rate),
        config=art.SFTConfig(learning_rate=5e-3, epochs=args.warm_epochs, batch_size=16, seed=seed),
    )
    for model in models.values():
        if model is not first:
            shutil.copytree(
                backend.model_dir(first) / "checkpoints", backend.model_dir(model) / "checkpoints"
            )
            await model.register(backend)
    rows = []
    for arm, model in models.items():
        if arm not in args.arms:
            continue
        config = config_of(arm, args, seed)
        curve, progress, trained = [], [], []
        for k in range(args.steps):
            groups = await art.gather_trajectory_groups(
                groups_for(model, args.group_size, (seed + 1) * 1_000_003 + k * 10_007), pbar_desc=None
            )
            curve.append(success_of(groups))
            progress.append(success_of(groups, "progress"))
            result = await model.train(groups, config=config)
            trained.append(int(result.get("trained_tokens", 0)))  # 0: every group's rewards were equal
        evaluation = await art.gather_trajectory_groups(
            groups_for(model, args.eval_samples, 7919 + seed), pbar_desc=None
        )
        rows.append(
            {
                "seed": seed,
                "arm": arm,
                "curve": curve,
                "progress": progress,
                "trained_tokens": trained,
                "success": success_of(evaluation),
                "eval_progress": success_of(evaluation, "progress"),
            }
        )
        print(
            f"  seed {seed} {arm}: final success {rows[-1]['success']:.3f}, success per step {curve}, "
            f"progress per step {[round(p, 3) for p in progress]}, trained tokens per step {trained}",
            flush=True,
        )
    return rows


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step (1-based) whose success, averaged with its neighbours, reaches `target` (None: never)."""
    for k in range(len(curve)):
        window = curve[max(k - 1, 0) : k + 2]
        if statistics.mean(window) >= target:
            return k + 1
    return None


def summarize(rows: list[dict[str, Any]]) -> None:
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    steps = min(len(r["curve"]) for r in rows)
    mean_curve = {
        arm: [
            statistics.mean(by[(arm, s)]["curve"][k] for s in seeds if (arm, s) in by) for k in range(steps)
        ]
        for arm in arms
    }
    mean_progress = {
        arm: [
            statistics.mean(
                by[(arm, s)].get("progress", [math.nan] * steps)[k] for s in seeds if (arm, s) in by
            )
            for k in range(steps)
        ]
        for arm in arms
    }
    print(f"\nmean training success per step (chain progress in brackets; {len(seeds)} seeds)\n")
    print("| step | " + " | ".join(arms) + " |")
    print("|---:|" + "---:|" * len(arms))
    for k in range(steps):
        cells = [f"{mean_curve[a][k]:.3f} ({mean_progress[a][k]:.3f})" for a in arms]
        print(f"| {k + 1} | " + " | ".join(cells) + " |")
    target = statistics.mean(mean_curve["trajectory"][-2:]) if "trajectory" in arms else float("nan")
    print(f"\n'trajectory' final training success (mean of its last 2 steps): {target:.3f}\n")
    print(
        "| arm | eval success (mean) | paired diff vs trajectory [95 % CI] | steps to reach trajectory's final |"
    )
    print("|---|---:|---:|---:|")
    for arm in arms:
        success = [by[(arm, s)]["success"] for s in seeds if (arm, s) in by]
        paired = [s for s in seeds if (arm, s) in by and ("trajectory", s) in by]
        diffs = [by[(arm, s)]["success"] - by[("trajectory", s)]["success"] for s in paired]
        mean, low, high = paired_interval(diffs) if diffs else (float("nan"),) * 3
        reach = steps_to_reach(mean_curve[arm], target) if target > 0 else None
        reached = f"{reach} ({reach / steps:.2f}x of {steps})" if reach else "not reached"
        if target <= 0:
            reached = "n/a: 'trajectory' never succeeded"
        print(
            f"| {arm} | {statistics.mean(success):.3f} ({len(success)} seeds) | "
            f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] | {reached} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--right-rate", type=float, default=0.2, help="the warm start's share of right calls")
    parser.add_argument(
        "--warm-epochs", type=int, default=48, help="SFT epochs over the 64 warm-start examples"
    )
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--gigpo-weight", type=float, default=1.0)
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed (split a long run in parts)")
    parser.add_argument("--json", default=None, help="also write the rows here (appends to an existing file)")
    parser.add_argument("--summarize", default=None, help="only print the tables of a --json file")
    args = parser.parse_args()
    if args.summarize:
        summarize(json.loads(Path(args.summarize).read_text()))
        return
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    rows = asyncio.run(run(args))
    if args.json:
        path = Path(args.json)
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + rows, indent=1))
    summarize(rows)


if __name__ == "__main__":
    main()
