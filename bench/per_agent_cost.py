"""What per-agent adapters cost the trainer, as ratios in one run on the same tokens: step time with N agents'
adapters (N optimizer steps, each on its agent's share of the calls) against one adapter trained on all of them,
and the trainer memory each added adapter takes (its LoRA parameters + its AdamW moments, counted from the live
tensors; on CUDA also the peak allocated per arm). Goal: step time <= 1.3x one adapter with 4 agents; memory grows
by each adapter's parameters and optimizer state only.

Both arms start from the same seed and train the same groups (each trajectory holds one call per agent, sampled
once from the fresh policy); the arms alternate, one warm-up step each, and the median of `--repeats` steps counts.
Usage: python bench/per_agent_cost.py [--agents 4] [--repeats 5] [--group-size 8] [--new-tokens 16] [--rank 16]
       [--base-model PATH] [--json rows.json]   |   --summarize rows.json
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
from async_pipeline import append_rows, rows_of  # noqa: E402 - the benches' shared helpers

PROMPTS = ["Plan the order.", "What next?", "Handle the refund.", "Check the stock."]


def groups_for(trainer: Any, agents: list[str], args: argparse.Namespace) -> list[Any]:
    import torch

    import art_adapters as art
    from art_adapters.training.tokenize import chat_template_ids

    gen = torch.Generator().manual_seed(0)
    trainer.model.eval()
    groups = []
    for text in PROMPTS:
        rows: list[list[Any]] = [[] for _ in range(args.group_size)]
        for agent in agents:
            messages = [{"role": "user", "content": f"{text} ({agent})"}]
            prompt = chat_template_ids(trainer.tokenizer, messages, None)
            with torch.no_grad():
                ids = torch.tensor([prompt] * args.group_size)
                logprobs = []
                for _ in range(args.new_tokens):
                    dist = trainer.model(input_ids=ids).logits[:, -1].float().log_softmax(-1)
                    token = torch.multinomial(dist.exp(), 1, generator=gen)
                    logprobs.append(dist.gather(-1, token))
                    ids = torch.cat([ids, token], dim=1)
            for i, (row, lps) in enumerate(
                zip(ids[:, len(prompt) :].tolist(), torch.cat(logprobs, dim=1).tolist(), strict=True)
            ):
                rows[i].append(
                    art.LLMCall(
                        request={"messages": messages, "temperature": 1.0},
                        prompt_token_ids=prompt,
                        completion_token_ids=row,
                        logprobs=lps,
                        logprobs_mode="processed_logprobs",
                        source=art.CallSource(role=agent),
                    )
                )
        trajectories = [art.Trajectory(llm_calls=calls, reward=float(i % 3)) for i, calls in enumerate(rows)]
        groups.append(art.TrajectoryGroup(trajectories))
    return groups


def slot_bytes(params: list[Any], optimizer: Any) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) of one adapter."""
    weights = sum(p.numel() * p.element_size() for p in params)
    state = sum(
        v.numel() * v.element_size()
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if hasattr(v, "numel")
    )
    return weights, state


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import art_adapters as art
    from art_adapters.config import LoRAConfig, TrainConfig
    from art_adapters.tiny import tiny_model_path
    from art_adapters.training.per_agent import PerAgentTrainer
    from art_adapters.training.trainer import Trainer

    base = args.base_model or str(tiny_model_path())
    lora = LoRAConfig(rank=args.rank, alpha=2 * args.rank)
    agents = [f"agent{i}" for i in range(args.agents)]
    cuda = torch.cuda.is_available()
    peaks: dict[str, float] = {}
    single = Trainer(base, lora, engine="peft", seed=0)
    per = PerAgentTrainer(base, lora, per_agent=art.PerAgent(by="role", agents=agents), seed=0)
    groups = groups_for(single, agents, args)
    config = TrainConfig(learning_rate=1e-4)
    times: dict[str, list[float]] = {"single": [], "per_agent": []}
    arms = {"single": single, "per_agent": per}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for arm, trainer in arms.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            metrics = trainer.train_step(groups, config)
            if cuda:
                torch.cuda.synchronize()
                peaks[arm] = max(peaks.get(arm, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            if repeat:
                times[arm].append(time.perf_counter() - started)
            if arm == "single":
                tokens = metrics["trained_tokens"]
            else:
                assert metrics["trained_tokens"] == tokens, "the arms must train the same tokens"
    shared_w, shared_s = slot_bytes(per.slots[""].params, per.slots[""].optimizer)
    per_adapter = [slot_bytes(per.slots[a].params, per.slots[a].optimizer) for a in per.agents]
    single_w, single_s = slot_bytes(single.params, single.optimizer)
    return {
        "base_model": Path(base).name,
        "device": str(single.device),
        "agents": args.agents,
        "rank": args.rank,
        "trained_tokens": tokens,
        "single_step_s": statistics.median(times["single"]),
        "per_agent_step_s": statistics.median(times["per_agent"]),
        "step_ratio": statistics.median(times["per_agent"]) / statistics.median(times["single"]),
        "adapter_param_bytes": per_adapter[0][0],
        "adapter_optimizer_bytes": per_adapter[0][1],
        "single_trainable_bytes": single_w + single_s,
        "per_agent_trainable_bytes": shared_w + shared_s + sum(w + s for w, s in per_adapter),
        "peak_gib": peaks,
    }


def summarize(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| base | device | agents | rank | tokens | 1 adapter s/step | N adapters s/step | ratio (goal <= 1.3) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['base_model']} | {r['device']} | {r['agents']} | {r['rank']} | {r['trained_tokens']} | "
            f"{r['single_step_s']:.3f} | {r['per_agent_step_s']:.3f} | {r['step_ratio']:.2f} |"
        )
    print(
        "\n| agents | per adapter: params MiB | + AdamW MiB | trainable+optimizer: 1 adapter MiB | N+shared MiB | peak GiB |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        mib = 2**20
        print(
            f"| {r['agents']} | {r['adapter_param_bytes'] / mib:.2f} | {r['adapter_optimizer_bytes'] / mib:.2f} | "
            f"{r['single_trainable_bytes'] / mib:.2f} | {r['per_agent_trainable_bytes'] / mib:.2f} | "
            f"{r['peak_gib'] or 'CPU: n/a'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-model", default=None, help="a local model folder (default: the tiny model)")
    parser.add_argument("--json", default=None, help="also write the row here (appends to an existing file)")
    parser.add_argument("--summarize", default=None, help="only print the tables of a --json file")
    args = parser.parse_args()
    if args.summarize:
        summarize(rows_of(json.loads(Path(args.summarize).read_text())))
        return
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    row = run(args)
    if args.json:
        append_rows(Path(args.json), [row])
    summarize([row])


if __name__ == "__main__":
    main()
