"""What running a batch's common prefix once saves (training/shared_prefix.py): the demo's agent prompt (its system
prompt and four tool schemas, ~575 shared tokens) through one SFT step of 16 examples and one GRPO step of 2 groups
x 8 rollouts (its gradients), with sharing off and on, interleaved in one process on the tiny model (PEFT, fp32,
CPU). Both give the same loss and gradients; the ratio is the figure.
Usage: python bench/shared_prefix.py [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def workload() -> tuple[Any, list[Any], list[Any]]:
    """The trainer, the demo's first 16 warm-start examples, and 2 groups of 8 one-call rollouts of its prompt."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from art_adapters.config import LoRAConfig
    from art_adapters.demo.agent import SYSTEM, order_tools
    from art_adapters.demo.orders import warm_start_examples
    from art_adapters.envs.sqlite import build_database
    from art_adapters.tiny import tiny_model_path
    from art_adapters.training.samples import sft_samples
    from art_adapters.training.trainer import Trainer
    from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

    db = build_database(Path(tempfile.mkdtemp(prefix="bench-prefix-")) / "shop.sqlite", seed=0)
    tools = [convert_to_openai_tool(t) for t in order_tools(db)]
    examples = warm_start_examples(db, tools, SYSTEM, 16, 0)
    trainer = Trainer(tiny_model_path(), LoRAConfig(rank=16, alpha=32), engine="peft")
    rng = random.Random(0)
    groups = []
    for g in range(2):
        rollouts = []
        for example in examples[g * 8 : (g + 1) * 8]:
            sample = sft_samples(example, trainer.tokenizer)[0]  # the first call: its prompt and its answer
            prompt, completion = sample.prompt_ids, sample.completion_ids
            logprobs = trainer.logprobs_of([*prompt, *completion], start=len(prompt))
            call = LLMCall(
                request={"messages": [], "temperature": 1.0},
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=logprobs,
                logprobs_mode="processed_logprobs",
            )
            rollouts.append(Trajectory(llm_calls=[call], reward=rng.random()))
        groups.append(TrajectoryGroup(rollouts))
    return trainer, examples, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from art_adapters.config import SFTConfig, TrainConfig
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    trainer, examples, groups = workload()
    prompt = len(groups[0].trajectories[0].llm_calls[0].prompt_token_ids)
    # SFT at lr 1e-12 (Adam moves each weight by about that): every step sees the same weights, so losses compare
    times: dict[tuple[str, bool], list[float]] = {}
    losses: dict[tuple[str, bool], float] = {}
    for _ in range(args.repeats):  # interleaved: load changes on a shared machine hit both sides alike
        for share in (False, True):
            trainer.scorer.share_prefix = share
            for name, step in (
                (
                    "SFT step (16 examples)",
                    lambda: trainer.sft_step(examples, SFTConfig(learning_rate=1e-12)),
                ),
                ("GRPO gradients (2 x 8 rollouts)", lambda: trainer.compute_gradients(groups, TrainConfig())),
            ):
                for _ in range(args.steps):
                    started = time.perf_counter()
                    metrics = step()
                    times.setdefault((name, share), []).append(time.perf_counter() - started)
                    grads = [p.grad.norm() ** 2 for p in trainer.params if p.grad is not None]
                    check = float(metrics["loss"]) if name.startswith("SFT") else float(sum(grads) ** 0.5)
                    losses[name, share] = check
    print(f"\nworkload: the demo's prompt ({prompt} tokens), tiny model, LoRA r=16, fp32, PEFT, CPU; "
          f"{args.steps} steps x {args.repeats} interleaved runs (median)\n")  # fmt: skip
    print("| step | plain s | shared prefix s | ratio | SFT loss or GRPO gradient norm, plain / shared |")
    print("|---|---:|---:|---:|---|")
    for name in dict.fromkeys(n for n, _ in times):
        plain, shared = (statistics.median(times[name, s]) for s in (False, True))
        print(f"| {name} | {plain:.3f} | {shared:.3f} | {shared / plain:.2f}x | "
              f"{losses[name, False]:.6f} / {losses[name, True]:.6f} |")  # fmt: skip


if __name__ == "__main__":
    main()
