"""Shared adapter vs one adapter per agent on a two-agent task whose agents' ideal behaviours conflict under one
adapter, on the tiny model (trainer only, CPU or GPU; no engine: each agent samples from the trainer's own policy).

The task: for the same prompts, the planner succeeds when its first answer token is a low byte (ids 0-95, "call
tool X") and the executor when it is a high byte (ids 96-191, "answer in the fixed format"). Each trajectory holds
one planner call and one executor call on the same prompt; `rewards_by_role` credits each role its own success
(per-role rewards), the trajectory's reward is their mean. Success = the mean of the two agents' exact probability
of success at the first answer position over the prompts (no sampling noise), after each step.

Both arms share seeds (the same initial adapter, the same sampling generator seed), so differences are paired: the
table gives each arm's mean success per step, the final paired difference (per-agent - shared) with its 95 %
t-interval over seeds, and the steps per-agent needs to reach the shared arm's final success (goal: <= 0.7 x, or a
final success >= 0.1 higher).
Usage: python bench/per_agent_learning.py [--steps 12] [--seeds 6] [--group-size 8] [--json rows.json]
       python bench/per_agent_learning.py --summarize rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_pipeline import append_rows, paired_interval, rows_of  # noqa: E402 - the benches' shared helpers

PROMPTS = ["Plan the order.", "What next?", "Handle the refund.", "Check the stock."]
WANTED = {"planner": range(0, 96), "executor": range(96, 192)}
ARMS = ("shared", "per_agent")


def make_trainer(arm: str, seed: int, args: argparse.Namespace) -> Any:
    import art_adapters as art
    from art_adapters.config import LoRAConfig
    from art_adapters.tiny import tiny_model_path
    from art_adapters.training.per_agent import PerAgentTrainer
    from art_adapters.training.trainer import Trainer

    lora = LoRAConfig(rank=args.rank, alpha=2 * args.rank)
    if arm == "shared":
        return Trainer(tiny_model_path(), lora, engine="peft", seed=seed)
    return PerAgentTrainer(tiny_model_path(), lora, per_agent=art.PerAgent(by="role"), seed=seed)


def use(trainer: Any, agent: str) -> None:
    """Sample and score as `agent`: its adapter in the per-agent arm (a fresh one the first time), else shared."""
    if hasattr(trainer, "slots"):
        trainer.add_adapter(agent)
        trainer.use(agent)


def rollouts(trainer: Any, step: int, seed: int, args: argparse.Namespace) -> list[Any]:
    import torch

    import art_adapters as art
    from art_adapters.training.tokenize import chat_template_ids

    gen = torch.Generator().manual_seed(seed * 10_007 + step)
    groups = []
    for text in PROMPTS:
        prompt = chat_template_ids(trainer.tokenizer, [{"role": "user", "content": text}], None)
        calls: dict[str, list[Any]] = {}
        for agent in WANTED:
            use(trainer, agent)
            calls[agent] = sample(trainer, prompt, text, agent, args, gen)
        if hasattr(trainer, "slots"):
            trainer.use("")
        trajectories = []
        for i in range(args.group_size):
            roles = {a: float(calls[a][i].completion_token_ids[0] in WANTED[a]) for a in WANTED}
            trajectories.append(
                art.Trajectory(
                    llm_calls=[calls[a][i] for a in WANTED],
                    reward=sum(roles.values()) / len(roles),
                    rewards_by_role=roles,
                )
            )
        groups.append(art.TrajectoryGroup(trajectories))
    return groups


def sample(
    trainer: Any, prompt: list[int], text: str, agent: str, args: argparse.Namespace, gen: Any
) -> list:
    import torch

    import art_adapters as art

    trainer.model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt] * args.group_size)
        logprobs = []
        for _ in range(args.new_tokens):
            dist = trainer.model(input_ids=ids).logits[:, -1].float().log_softmax(-1)
            token = torch.multinomial(dist.exp(), 1, generator=gen)
            logprobs.append(dist.gather(-1, token))
            ids = torch.cat([ids, token], dim=1)
    rows, lps = ids[:, len(prompt) :].tolist(), torch.cat(logprobs, dim=1).tolist()
    return [
        art.LLMCall(
            request={"messages": [{"role": "user", "content": text}], "temperature": 1.0},
            prompt_token_ids=prompt,
            completion_token_ids=row,
            logprobs=lp,
            logprobs_mode="processed_logprobs",
            source=art.CallSource(role=agent),
        )
        for row, lp in zip(rows, lps, strict=True)
    ]


def success(trainer: Any) -> float:
    """Mean over agents and prompts of the probability that the agent's first answer token succeeds."""
    import torch

    from art_adapters.training.tokenize import chat_template_ids

    total = 0.0
    trainer.model.eval()
    for agent, wanted in WANTED.items():
        use(trainer, agent)
        with torch.no_grad():
            for text in PROMPTS:
                prompt = chat_template_ids(trainer.tokenizer, [{"role": "user", "content": text}], None)
                probs = trainer.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
                total += float(probs[list(wanted)].sum())
    if hasattr(trainer, "slots"):
        trainer.use("")
    return total / (len(WANTED) * len(PROMPTS))


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from art_adapters.config import TrainConfig

    trainer = make_trainer(arm, seed, args)
    config = TrainConfig(learning_rate=args.learning_rate)
    curve = [success(trainer)]
    started = time.perf_counter()
    for step in range(args.steps):
        trainer.train_step(rollouts(trainer, step, seed, args), config)
        curve.append(success(trainer))
    trainer.close()
    return {"arm": arm, "seed": seed, "curve": curve, "seconds": time.perf_counter() - started}


def steps_to_reach(curve: list[float], target: float) -> int | None:
    return next((i for i, value in enumerate(curve) if value >= target), None)


def summarize(rows: list[dict[str, Any]]) -> None:
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows if all((a, r["seed"]) in by for a in ARMS)})
    if not seeds:
        print("no seed has both arms")
        return
    steps = min(len(by[(a, s)]["curve"]) for a in ARMS for s in seeds)
    print(f"\n{len(seeds)} paired seeds; mean success per step (step 0 = before training)\n")
    print("| step | shared | per-agent | paired diff [95 % CI] |")
    print("|---:|---:|---:|---:|")
    for i in range(steps):
        shared = [by[("shared", s)]["curve"][i] for s in seeds]
        mine = [by[("per_agent", s)]["curve"][i] for s in seeds]
        mean, low, high = paired_interval([m - x for m, x in zip(mine, shared, strict=True)])
        print(
            f"| {i} | {statistics.mean(shared):.3f} | {statistics.mean(mine):.3f} | "
            f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] |"
        )
    ratios = []
    for s in seeds:
        target = by[("shared", s)]["curve"][steps - 1]
        reached = steps_to_reach(by[("per_agent", s)]["curve"][:steps], target)
        ratios.append(reached / (steps - 1) if reached is not None and steps > 1 else float("nan"))
    final = [by[("per_agent", s)]["curve"][steps - 1] - by[("shared", s)]["curve"][steps - 1] for s in seeds]
    mean, low, high = paired_interval(final)
    print(
        f"\nfinal paired difference (per-agent - shared): {mean:+.3f} [95 % CI {low:+.3f}, {high:+.3f}]; "
        f"steps for per-agent to reach shared's final success / shared's steps: mean "
        f"{statistics.mean(ratios):.2f} (per seed {', '.join(f'{r:.2f}' for r in ratios)}); goal: <= 0.7, or a "
        "final difference >= +0.1"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed (split a long run in parts)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-2)
    parser.add_argument("--json", default=None, help="also write the rows here (appends to an existing file)")
    parser.add_argument("--summarize", default=None, help="only print the tables of a --json file")
    args = parser.parse_args()
    if args.summarize:
        summarize(rows_of(json.loads(Path(args.summarize).read_text())))
        return
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    rows = []
    for seed in range(args.seed_offset, args.seed_offset + args.seeds):
        for arm in ARMS:
            rows.append(run_arm(arm, seed, args))
            print(f"seed {seed} {arm}: success {rows[-1]['curve'][0]:.3f} -> {rows[-1]['curve'][-1]:.3f}")
    if args.json:
        append_rows(Path(args.json), rows)
    summarize(rows)


if __name__ == "__main__":
    main()
