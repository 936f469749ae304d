"""Credit per turn, measured: "trajectory" (GRPO) vs "turn" vs "gigpo" on a multi-turn tool chain with the tiny model,
the same steps, rollout seeds and warm start for every estimator, repeated over seeds; differences are paired.

The task: a support agent must call 3 tools in order (`query`, then `day`, then `capital`; each name one token of the
tiny tokenizer). A wrong call is answered "wrong tool, try again" and costs a turn, so an early mistake can be
repaired later; at most 5 turns. Every call is rewarded on its own (`art.reward_call`: 1/3 when it advances the chain,
0 otherwise) and the trajectory gets 1.0 when the chain completes (success). Tool call ids and arguments are
normalised before they go back to the model, so rollouts that made the same choices reach the same prompt token ids:
states repeat across a group, which GiGPO's step groups need. Every arm sees the same rewards ("trajectory" trains on
their sum); only the estimator differs.

Reported: mean training success per step (each step's rollouts, over seeds); each arm's paired difference to
"trajectory" with a 95 % t-interval over seeds, on the final evaluation (128 rollouts), on the last 3 steps and on the
mean over all steps; the steps each arm's trailing 3-step mean takes to reach "trajectory"'s final one (the goal:
the better of turn/GiGPO within 0.7x the steps; not decidable unless "trajectory" learned, +0.1 over its first step);
and the seeds whose evaluation ended below their own first step (collapsed).
The warm start (192 SFT steps, its rate falling linearly from 5e-3 to 0) teaches the multi-turn call format, calling
until the chain completes or the turns run out; each call is the right tool with p = 0.2, else one of the four at
random (right 40 % of the time in all): 0.17-0.23 success over seeds 0-3 on a 64-rollout evaluation.
Usage: python bench/turn_credit.py [--steps 12] [--group-size 8] [--seeds 6] [--eval-samples 32] [--gamma 1.0]
       [--gigpo-weight 1.0] [--right-rate 0.2] [--warm-epochs 48] [--arms trajectory turn gigpo]
       [--json rows.json] [--seed-offset 0] | --summarize rows.json [more.json ...] [--plot curves.png]
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
from async_pipeline import append_rows, over_seeds, paired_interval, rows_of  # noqa: E402 - shared helpers

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


SETTINGS = ("steps", "group_size", "eval_samples", "learning_rate", "gamma", "gigpo_weight", "right_rate",
            "warm_epochs", "warm_lr", "warm_decay")  # fmt: skip


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    def save(rows: list[dict[str, Any]]) -> None:  # each seed as it ends: a later failure loses only its own
        if args.json:
            append_rows(Path(args.json), rows)

    return await over_seeds(args, run_seed, "bench-turns-", on_seed=save)


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
    arms = [arm for arm in ARMS if arm in args.arms]
    models = {
        arm: art.TrainableModel(name=f"chain-{seed}-{arm}", project="bench", base_model=base, lora=lora)
        for arm in arms
    }
    first = models[arms[0]]
    await first.register(backend)
    batches = math.ceil(64 / 16) * args.warm_epochs
    # decaying to 0: at a constant 5e-3 the last batches left some seeds mid-oscillation (final loss 0.13-0.18
    # against 0.10, and a format the agent could not produce: no tool call parsed at its first turn)
    rates = [args.warm_lr * (1 - i / batches) for i in range(batches)] if args.warm_decay else args.warm_lr
    warm = await first.train_sft(
        warm_start(64, seed, args.right_rate),
        config=art.SFTConfig(learning_rate=rates, epochs=args.warm_epochs, batch_size=16, seed=seed),
    )
    for model in models.values():
        if model is not first:
            shutil.copytree(
                backend.model_dir(first) / "checkpoints", backend.model_dir(model) / "checkpoints"
            )
            await model.register(backend)
    rows = []
    for arm, model in models.items():
        config = config_of(arm, args, seed)
        curve, progress, trained, grad_norm = [], [], [], []
        for k in range(args.steps):
            groups = await art.gather_trajectory_groups(
                groups_for(model, args.group_size, (seed + 1) * 1_000_003 + k * 10_007), pbar_desc=None
            )
            curve.append(success_of(groups))
            progress.append(success_of(groups, "progress"))
            result = await model.train(groups, config=config)
            trained.append(int(result.get("trained_tokens", 0)))  # 0: every group's rewards were equal
            grad_norm.append(float(result.get("grad_norm", math.nan)))
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
                "grad_norm": grad_norm,
                "settings": {name: getattr(args, name) for name in SETTINGS},
                "success": success_of(evaluation),
                "eval_progress": success_of(evaluation, "progress"),
                "eval_turns": success_of(evaluation, "turns"),
                "warm_final_loss": float(warm.get("final_loss", math.nan)),
            }
        )
        print(
            f"  seed {seed} {arm}: final success {rows[-1]['success']:.3f}, success per step {curve}, "
            f"progress per step {[round(p, 3) for p in progress]}, trained tokens per step {trained}",
            flush=True,
        )
    return rows


WINDOW = 3  # steps in the trailing mean that smooths a success curve (32 rollouts a step)
LEARNED = 0.1  # "trajectory" must end this far above its first step for "steps to reach it" to mean anything


def trailing(curve: list[float], k: int) -> float:
    """The mean of step k (0-based) and the WINDOW - 1 steps before it: no look-ahead."""
    return statistics.mean(curve[max(k - WINDOW + 1, 0) : k + 1])


TIE = 1e-9  # success rates are multiples of 1/(seeds x rollouts): far coarser than this, far finer than float error


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step (1-based) whose trailing mean reaches `target` (None: never). A tie counts as reached: the
    same rational mean summed in another order can come out one float ulp below (305/576 in the 6-seed rows)."""
    return next((k + 1 for k in range(len(curve)) if trailing(curve, k) >= target - TIE), None)


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    """The rows of one or more --json files; refuses a seed run twice or rows made with different settings."""
    rows = [row for path in paths for row in rows_of(json.loads(Path(path).read_text()))]
    seen: set[tuple[str, int]] = set()
    for row in rows:
        key = (row["arm"], row["seed"])
        if key in seen:
            sys.exit(f"{key[0]!r} seed {key[1]} appears twice in {paths}: keep one run of each seed")
        seen.add(key)
    settings = {json.dumps(row.get("settings"), sort_keys=True) for row in rows}
    if len(settings) > 1:
        sys.exit(f"rows made with different settings cannot be compared: {sorted(settings)}")
    return rows


def paired_cell(by: dict[tuple[str, int], Any], arm: str, seeds: list[int], value: Any) -> str:
    """`value(row)` of `arm` minus that of "trajectory", paired by seed, with its 95 % t-interval."""
    paired = [s for s in seeds if (arm, s) in by and ("trajectory", s) in by]
    if arm == "trajectory" or not paired:
        return ""
    mean, low, high = paired_interval([value(by[(arm, s)]) - value(by[("trajectory", s)]) for s in paired])
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def summarize(rows: list[dict[str, Any]]) -> None:
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    steps = min(len(r["curve"]) for r in rows)

    def mean_over_seeds(arm: str, key: str, k: int) -> float:
        return statistics.mean(by[(arm, s)].get(key, [math.nan] * steps)[k] for s in seeds if (arm, s) in by)

    mean_curve = {arm: [mean_over_seeds(arm, "curve", k) for k in range(steps)] for arm in arms}
    print(f"\nmean training success per step (chain progress in brackets; {len(seeds)} seeds)\n")
    print("| step | " + " | ".join(arms) + " |")
    print("|---:|" + "---:|" * len(arms))
    for k in range(steps):
        cells = [f"{mean_curve[a][k]:.3f} ({mean_over_seeds(a, 'progress', k):.3f})" for a in arms]
        print(f"| {k + 1} | " + " | ".join(cells) + " |")

    def last(row: dict[str, Any]) -> float:  # each seed's success over its last WINDOW steps
        return statistics.mean(row["curve"][steps - WINDOW : steps])

    def area(row: dict[str, Any]) -> float:  # each seed's mean success over all steps: how fast it learned
        return statistics.mean(row["curve"][:steps])

    print(
        f"\n| arm | eval success (mean) | paired diff vs trajectory, eval [95 % CI] | last {WINDOW} steps [95 % CI] | "
        "mean over all steps [95 % CI] | steps to reach trajectory's final | collapsed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")

    def collapsed(arm: str) -> str:  # seeds whose evaluation ended below the arm's own first step
        mine = [by[(arm, s)] for s in seeds if (arm, s) in by]
        return f"{sum(r['success'] < r['curve'][0] for r in mine)} / {len(mine)}"

    reach: dict[str, int | None] = {}
    target = trailing(mean_curve["trajectory"], steps - 1) if "trajectory" in arms else math.nan
    learned = "trajectory" in arms and target >= mean_curve["trajectory"][0] + LEARNED
    for arm in arms:
        success = [by[(arm, s)]["success"] for s in seeds if (arm, s) in by]
        reach[arm] = steps_to_reach(mean_curve[arm], target) if learned else None
        reached = f"{reach[arm]} ({reach[arm] / steps:.2f}x of {steps})" if reach[arm] else "not reached"
        if not learned:
            reached = (
                "n/a: 'trajectory' did not learn" if "trajectory" in arms else "n/a: no 'trajectory' arm"
            )
        print(
            f"| {arm} | {statistics.mean(success):.3f} ({len(success)} seeds) | "
            f"{paired_cell(by, arm, seeds, lambda r: r['success'])} | {paired_cell(by, arm, seeds, last)} | "
            f"{paired_cell(by, arm, seeds, area)} | {reached} | {collapsed(arm)} |"
        )
    if not learned:
        why = f"did not end {LEARNED} above its first step" if "trajectory" in arms else "was not run"
        print(f"\ngoal not decidable: 'trajectory' {why}")
        return
    print(
        f"\n'trajectory' final training success (trailing mean of its last {WINDOW} steps): {target:.3f}, "
        f"from {mean_curve['trajectory'][0]:.3f} at step 1"
    )
    contenders = {arm: reach[arm] for arm in ("turn", "gigpo") if arm in arms}
    if contenders:
        best = min(contenders, key=lambda a: contenders[a] or steps + 1)
        within = contenders[best] is not None and contenders[best] <= 0.7 * steps
        print(
            f"goal (the better of turn/GiGPO reaches it within 0.7x the steps): {'met' if within else 'not met'}"
            f" -- {best} at {contenders[best] or 'never'} of {steps} steps (on the mean curve, no interval)"
        )


def plot_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean training success (solid) and chain progress (dashed) per step, one colour per arm, over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    seeds = sorted({r["seed"] for r in rows})
    steps = min(len(r["curve"]) for r in rows)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, arm in enumerate(arms):
        mine = [r for r in rows if r["arm"] == arm]
        for key, style in (("curve", "-"), ("progress", "--")):
            mean = [statistics.mean(r[key][k] for r in mine) for k in range(steps)]
            label = f"{arm} ({'success' if key == 'curve' else 'progress'})"
            marker = "o" if key == "curve" else None
            ax.plot(range(1, steps + 1), mean, style, color=f"C{i}", marker=marker, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean over {len(seeds)} seeds")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--eval-samples", type=int, default=32, help="rollouts per scenario at the end (4 scenarios)"
    )
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--right-rate", type=float, default=0.2, help="the warm start's share of right calls")
    parser.add_argument(
        "--warm-epochs", type=int, default=48, help="SFT epochs over the 64 warm-start examples"
    )
    parser.add_argument("--warm-lr", type=float, default=5e-3, help="the warm start's (first) learning rate")
    parser.add_argument(
        "--warm-decay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the warm start's rate decays linearly to 0 (--no-warm-decay: constant)",
    )
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--gigpo-weight", type=float, default=1.0)
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed (split a long run in parts)")
    parser.add_argument("--json", default=None, help="also write each seed's rows here as it ends (appends)")
    parser.add_argument("--summarize", nargs="+", default=None, help="only print the tables of --json files")
    parser.add_argument(
        "--plot", default=None, help="with --summarize: also draw the mean curves into this PNG"
    )
    args = parser.parse_args()
    if args.summarize:
        rows = load_rows(args.summarize)
        summarize(rows)
        if args.plot:
            plot_curves(rows, Path(args.plot))
        return
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    summarize(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
