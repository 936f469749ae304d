"""Trained tokens/s and peak memory of one GRPO step: our trainer (PEFT, Unsloth) vs TRL's GRPOTrainer, CPU; and
the sharded path (FSDP2) on 2 processes vs 1: a real data-parallel step (several micro-batches per process) on a
32-layer model (~51M parameters, random weights), with each process's peak RSS and the most its frozen weights
held during a step.

Same tiny model, LoRA config, prompts, completions and group size; each side runs in its own subprocess.
`ours-peft+guard` is ours-peft with the step guard on (TrainConfig(max_token_drop=0.7)): what the guard costs a step.
Usage: `python bench/train_step.py [--steps 8] [--prompts 4] [--group 8] [--tokens 32] [--repeats 2] [--kinds ...]`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = ["hi", "What is two plus two?", "weather in Paris", "Tell me a number.", "Say yes.", "Count to 3."]
LORA = {"rank": 8, "alpha": 16, "modules_to_save": ["lm_head"]}
LR = 1e-3


def reward_of(ids: list[int]) -> float:
    return sum(t < 96 for t in ids) / max(len(ids), 1)


def make_data(path: Path, prompts: int, group: int, tokens: int) -> None:
    """Sample the completions once from the base model (fixed length, seeded), with their logprobs."""
    from art_adapters.training.quiet import quiet_import_notes, quiet_loading

    quiet_import_notes()  # optional kernels' import notes are not the bench's output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from art_adapters.tiny import tiny_model_path

    model_path = tiny_model_path()
    tok = AutoTokenizer.from_pretrained(model_path)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for text in (PROMPTS * 4)[:prompts]:
        messages = [{"role": "user", "content": text}]
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = torch.tensor([prompt] * group)
        lps = []
        with torch.no_grad():
            for _ in range(tokens):
                dist = model(input_ids=ids).logits[:, -1].float().log_softmax(-1)
                nxt = torch.multinomial(dist.exp(), 1, generator=gen)
                lps.append(dist.gather(-1, nxt))
                ids = torch.cat([ids, nxt], 1)
        completions = ids[:, len(prompt) :].tolist()
        rows.append(
            {
                "text": text,
                "prompt": prompt,
                "completions": completions,
                "logprobs": torch.cat(lps, 1).tolist(),
            }
        )
    path.write_text(
        json.dumps({"model": str(model_path), "rows": rows, "deep_model": str(deep_model(path.parent))})
    )


DEEP = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "layer_types": ["full_attention"] * 32,
    "max_window_layers": 32,
}
SHARDED_MICRO_BATCH_TOKENS = 256  # several micro-batches per process


def deep_model(folder: Path) -> Path:
    """The tiny model's tokenizer on 32 wider layers (the sharded rows' model: weights that show in memory)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from art_adapters.tiny import tiny_model_path

    tiny, out = tiny_model_path(), folder / "deep-model"
    out.mkdir(exist_ok=True)
    for file in tiny.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, out / file.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tiny, **DEEP), dtype=torch.float32
    ).save_pretrained(out)
    return out


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# TrainConfig(max_token_drop=...) of the "+guard" kind: the delta bench/async_pipeline.py measured
GUARD = 0.7


def run_ours(data: dict[str, Any], engine: str, steps: int, guard: float | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    from art_adapters.config import LoRAConfig, TrainConfig
    from art_adapters.training.trainer import Trainer
    from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

    trainer: Any
    sharded = engine.startswith("fsdp2x")
    if sharded:  # the sharded path: N processes (their memory is not in this RSS: each reports its own)
        from art_adapters.training.sharded import ShardedTrainer

        trainer = ShardedTrainer(
            data["deep_model"], LoRAConfig(**LORA), processes=int(engine[6:]), engine="peft"
        )
    else:
        trainer = Trainer(data["model"], LoRAConfig(**LORA), engine=engine)  # type: ignore[arg-type]
    setup_s = time.perf_counter() - t0
    groups = []
    for row in data["rows"]:
        trajectories = [
            Trajectory(
                llm_calls=[
                    LLMCall(
                        request={"temperature": 1.0},
                        prompt_token_ids=row["prompt"],
                        completion_token_ids=ids,
                        logprobs=lps,
                        logprobs_mode="processed_logprobs",
                    )
                ],
                reward=reward_of(ids),
            )
            for ids, lps in zip(row["completions"], row["logprobs"], strict=True)
        ]
        groups.append(TrajectoryGroup(trajectories))
    budget = SHARDED_MICRO_BATCH_TOKENS if sharded else 8192
    config = TrainConfig(learning_rate=LR, micro_batch_tokens=budget, max_grad_norm=1.0, max_token_drop=guard)
    trainer.train_step(groups, config)  # warm-up
    if sharded:
        trainer.memory(probe=True)
    baseline = rss_mib()
    times, tokens, metrics, guarded = [], 0, {}, 0
    for _ in range(steps if not sharded else max(2, steps // 4)):  # the sharded rows' model is 50x larger
        started = time.perf_counter()  # wall time, the processes' messages included
        metrics = trainer.train_step(groups, config)
        times.append(time.perf_counter() - started)
        tokens = metrics["trained_tokens"]
        guarded += int(metrics.get("guarded", 0))
    ranks = trainer.memory(probe=False) if sharded else []
    if hasattr(trainer, "close"):
        trainer.close()
    return {
        "engine": trainer.engine,
        "setup_s": setup_s,
        "times": times,
        "tokens": tokens,
        "guarded": guarded,
        "rss0": baseline,
        "ranks": ranks,
        "micro_batches": metrics.get("micro_batches", 1),
        "per_process": metrics.get("micro_batches_per_process", metrics.get("micro_batches", 1)),
    }


def run_trl(data: dict[str, Any], steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _torch_lm_head_for_trl()
    by_text = {r["text"]: r for r in data["rows"]}
    group = len(data["rows"][0]["completions"])
    served: dict[str, int] = {}

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            row = by_text[prompt[-1]["content"] if isinstance(prompt, list) else prompt]
            i = served.get(row["text"], 0) % group
            served[row["text"]] = i + 1
            out["prompt_ids"].append(row["prompt"])
            out["completion_ids"].append(row["completions"][i])
            out["logprobs"].append(row["logprobs"][i])
        return out

    def reward(
        prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        return [reward_of(ids) for ids in completion_ids]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0
            self.rss0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                self.rss0 = rss_mib()
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    rows = data["rows"]
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": r["text"]}] for r in rows] * (steps + 1)}
    )
    n = len(rows) * group
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        use_cpu=True,
        use_vllm=False,
        bf16=False,
        per_device_train_batch_size=n,
        num_generations=group,
        max_completion_length=len(rows[0]["completions"][0]),
        max_steps=steps + 1,
        learning_rate=LR,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",  # token-level normalization, as ours (normalization="token")
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32)
    peft_config = LoraConfig(
        r=LORA["rank"],
        lora_alpha=LORA["alpha"],
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=LORA["modules_to_save"],
        task_type="CAUSAL_LM",
    )
    timer = Timer()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
        rollout_func=rollout,
        callbacks=[timer],
    )
    setup_s = time.perf_counter() - t0
    trainer.train()
    tokens = sum(len(c) for r in rows for c in r["completions"])
    return {"engine": f"trl {trl.__version__}", "setup_s": setup_s, "times": timer.times[1:], "tokens": tokens,
            "rss0": timer.rss0}  # fmt: skip


def _torch_lm_head_for_trl() -> None:
    """TRL 1.15's fused LM head is a Triton kernel, and Triton has no CPU backend here: swap in the same maths in
    plain PyTorch (log-probs of the labelled positions only; entropy for TRL's metrics, without gradient)."""
    import torch
    import trl.trainer.utils as trl_utils

    class TorchChunkedLogProb:
        @staticmethod
        def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):  # noqa: ANN001, ANN205
            logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            logp = (logits / temperature).log_softmax(-1)
            logprobs = logp.gather(-1, labels[:, None]).squeeze(-1)
            entropy = None
            if "entropy" in outputs:
                with torch.no_grad():
                    entropy = -(logp.exp() * logp).sum(-1)
            return logprobs, entropy, None, None, None

    trl_utils._ChunkedLogProbFunction = TorchChunkedLogProb


def worker(kind: str, data_path: Path, steps: int) -> None:
    data = json.loads(data_path.read_text())
    engine, _, guard = kind.removeprefix("ours-").partition("+")
    if guard not in ("", "guard"):
        sys.exit(f"unknown kind {kind!r}: the one suffix is '+guard' (e.g. ours-peft+guard)")
    if kind == "trl":
        result = run_trl(data, steps)
    else:  # "ours-peft+guard": the same step with the step guard on (what it costs)
        result = run_ours(data, engine, steps, GUARD if guard == "guard" else None)
    result.update(kind=kind, peak_rss_mib=peak_rss_mib())
    print("RESULT " + json.dumps(result), flush=True)


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--kinds", default="ours-peft,ours-peft+guard,trl,ours-unsloth,ours-fsdp2x1,ours-fsdp2x2"
    )
    parser.add_argument("--worker", default=None)
    parser.add_argument("--data", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.data), args.steps)
        return
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    data = Path(tempfile.mkdtemp(prefix="bench-train-")) / "data.json"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import train_step as b; b.make_data(__import__('pathlib').Path({str(data)!r}), "
                    f"{args.prompts}, {args.group}, {args.tokens})"], check=True, env=env)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved, so load changes on a shared box hit every side alike
        for kind in args.kinds.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                kind,
                "--data",
                str(data),
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{kind} failed:\n{out.stderr[-4000:]}")
            results.setdefault(kind, []).append(json.loads(line[7:]))
    print(f"\nworkload: {args.prompts} prompts x {args.group} completions x {args.tokens} sampled tokens, "
          f"tiny model, LoRA r={LORA['rank']} + lm_head, fp32, CPU threads={os.cpu_count()}, "
          f"{args.steps} timed steps x {args.repeats} runs (median)\n")  # fmt: skip
    print(
        "| trainer | step s (median) | trained tokens/s | peak RSS MiB | RSS growth in loop MiB | setup s |"
    )
    print("|---|---|---|---|---|---|")
    summary = {}
    for kind, runs in results.items():
        if kind.startswith("ours-fsdp2"):
            continue
        step = median([t for r in runs for t in r["times"]])
        peak = max(r["peak_rss_mib"] for r in runs)
        grow = max(r["peak_rss_mib"] - r["rss0"] for r in runs)
        summary[kind] = (runs[0]["tokens"] / step, peak)
        print(f"| {runs[0]['engine']} ({kind}) | {step:.3f} | {runs[0]['tokens'] / step:,.0f} | {peak:,.0f} | "
              f"{grow:,.0f} | {median([r['setup_s'] for r in runs]):.1f} |")  # fmt: skip
    if "trl" in summary:
        base_tps, base_mem = summary["trl"]
        print()
        for kind, (tps, mem) in summary.items():
            if kind != "trl":
                print(f"- {kind} vs TRL: {tps / base_tps:.2f}x throughput, {mem / base_mem:.2f}x peak RSS")
    if {"ours-peft", "ours-peft+guard"} <= set(results):
        plain = median([t for r in results["ours-peft"] for t in r["times"]])
        guarded = median([t for r in results["ours-peft+guard"] for t in r["times"]])
        bound = sum(r["guarded"] for r in results["ours-peft+guard"])
        timed = sum(len(r["times"]) for r in results["ours-peft+guard"])
        print(f"- the step guard (max_token_drop={GUARD}) vs none: {guarded / plain:.2f}x step time; it bound on "
              f"{bound} of {timed} steps (a copy of the weights and a measuring forward: its cost when it does not)")  # fmt: skip
    sharded = {k: r for k, r in results.items() if k.startswith("ours-fsdp2")}
    if not sharded:
        return
    print(
        f"\nsharded (FSDP2, gloo) on the 32-layer model, micro-batch budget {SHARDED_MICRO_BATCH_TOKENS} tokens:\n"
    )
    print("| processes | step s (median) | micro-batches (per process) | peak RSS per process MiB | "
          "frozen weights held during a step, per process MiB |")  # fmt: skip
    print("|---|---|---|---|---|")
    rows = {}
    for kind, runs in sharded.items():
        step = median([t for r in runs for t in r["times"]])
        rss = max(rank["peak_rss_bytes"] for r in runs for rank in r["ranks"]) / 2**20
        held = max(rank["resident_weight_bytes_peak"] for r in runs for rank in r["ranks"]) / 2**20
        rows[kind] = (step, rss, held)
        print(f"| {kind.removeprefix('ours-fsdp2x')} | {step:.3f} | {runs[0]['micro_batches']} "
              f"({runs[0]['per_process']}) | {rss:,.0f} | {held:,.1f} |")  # fmt: skip
    if {"ours-fsdp2x1", "ours-fsdp2x2"} <= set(rows):
        (s1, r1, h1), (s2, r2, h2) = rows["ours-fsdp2x1"], rows["ours-fsdp2x2"]
        print(f"\n- 2 processes vs 1: {s2 / s1:.2f}x step time (2 shared cores: no speed to gain), "
              f"{r2 / r1:.2f}x peak RSS per process, {h2 / h1:.3f}x frozen weights held per process")  # fmt: skip


if __name__ == "__main__":
    main()
