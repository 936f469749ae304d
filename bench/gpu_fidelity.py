"""The trainer's fidelity on a CUDA GPU, in bf16: run when a GPU is lent (CI never has one). No model hub there, so
the models are built here: the tiny model, and a random Qwen2.5-0.5B-shaped one (896 wide, 24 layers, 151,936
vocabulary rows) whose final-norm gain makes its next-token distributions peaked like a trained model's.

This was bench/gpu_check.py; `make gpu-check` (bench/gpu_check.py) is now the memory and shared-GPU acceptance check
and must finish in 8 minutes on one H100, so these measurements moved here (run them separately, as time allows).

Measures, per model: the trainer's step time and peak memory with PEFT (Unsloth when importable), the same step on
the sharded path (FSDP2, one process: `ShardedTrainer`) and, on a host with two GPUs or more, on two processes
(GPUs 0 and 1: the loss and adapter against one process, each process's GPU peak and frozen weights held during
a step; with one GPU it says so and skips it); and the logprob gap between a bf16 sampler
(transformers' generate with its KV cache: vLLM is too big to carry there) and the trainer's bf16 forward, with the
clip fraction it causes for GRPO (0.2 per token), CISPO and GSPO (3e-4 / 4e-4 on the sequence's mean log-ratio).

python bench/gpu_fidelity.py --out /tmp/gpu     (writes gpu_fidelity.json; prints one table)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import FAMILY_GAIN, tiny_model_path
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

LORA = LoRAConfig(rank=16, alpha=32)
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4


def build_qwen_shaped(out: Path) -> Path:
    """A random Qwen2.5-0.5B-shaped model in bf16 with the tiny model's tokenizer (ids < 768 spell text; the
    other rows are sampled and trained as ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = tiny_model_path()
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=json.loads((tiny / "config.json").read_text())["bos_token_id"],
        eos_token_id=json.loads((tiny / "config.json").read_text())["eos_token_id"],
        pad_token_id=json.loads((tiny / "config.json").read_text())["pad_token_id"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.fill_(FAMILY_GAIN["qwen2.5"])
    model.save_pretrained(out)
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, out / name.name)
    del model
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def sample_groups(
    trainer: Trainer, groups: int, size: int, new_tokens: int
) -> tuple[list[TrajectoryGroup], float]:
    """Completions sampled by transformers' generate (bf16, KV cache) with their sampled logprobs; rewards random.
    Returns the groups and the mean entropy (nats) of the sampled distributions."""
    trainer.model.eval()
    gen = torch.Generator(device="cpu").manual_seed(1)
    out, entropies = [], []
    for g in range(groups):
        messages = [{"role": "user", "content": f"Question {g}: what comes next?"}]
        prompt = chat_template_ids(trainer.tokenizer, messages, None)
        ids = torch.tensor([prompt] * size, device=trainer.device)
        result = trainer.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=trainer.pad_id,
        )
        rows = result.sequences[:, len(prompt) :]
        logps = torch.stack([s.float().log_softmax(-1) for s in result.scores], dim=1)  # [size, T, V]
        chosen = logps.gather(-1, rows[..., None]).squeeze(-1)
        entropies.append(float(-(logps.exp() * logps).nan_to_num().sum(-1).mean()))
        trajectories = []
        eos = trainer.tokenizer.eos_token_id
        for row, lps in zip(rows.tolist(), chosen.tolist(), strict=True):
            end = row.index(eos) + 1 if eos in row else len(row)  # generate pads a finished row after its EOS
            row, lps = row[:end], lps[:end]
            call = LLMCall(
                request={"messages": messages, "temperature": 1.0},
                prompt_token_ids=prompt,
                completion_token_ids=row,
                logprobs=lps,
                logprobs_mode="processed_logprobs",
            )
            reward = float(torch.rand((), generator=gen))
            trajectories.append(Trajectory(llm_calls=[call], reward=reward))
        out.append(TrajectoryGroup(trajectories))
    return out, statistics.mean(entropies)


@torch.no_grad()
def logprob_gap(trainer: Trainer, groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Trainer (full forward, bf16) minus sampler logprobs of the sampled tokens, and what the losses' clips make
    of it on-policy (no update yet: every clipped token is the mismatch's doing)."""
    trainer.model.eval()
    token_gaps: list[float] = []
    seq_means: list[float] = []
    for group in groups:
        for trajectory in group:
            call = trajectory.llm_calls[0]
            row = list(call.prompt_token_ids) + list(call.completion_token_ids)
            start = len(call.prompt_token_ids)
            ours = trainer._token_logprobs([row], [list(range(start, len(row)))], [1.0]).tolist()
            gaps = [a - b for a, b in zip(ours, call.logprobs, strict=True)]
            token_gaps += gaps
            seq_means.append(sum(gaps) / len(gaps))
    absolute = sorted(abs(g) for g in token_gaps)
    outside = [m for m in seq_means if not (1 - GSPO_LOW <= math.exp(m) <= 1 + GSPO_HIGH)]
    return {
        "mean_abs_token_gap": statistics.mean(absolute),
        "p99_abs_token_gap": absolute[int(0.99 * (len(absolute) - 1))],
        "max_abs_token_gap": absolute[-1],
        "mean_abs_sequence_gap": statistics.mean(abs(m) for m in seq_means),
        "grpo_tokens_outside_0.2": sum(abs(math.exp(g) - 1) > 0.2 for g in token_gaps) / len(token_gaps),
        "gspo_sequences_outside_clip": len(outside) / len(seq_means),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(trainer: Any, groups: list[TrajectoryGroup], config: TrainConfig) -> dict[str, float]:
    sync()
    started = time.perf_counter()
    metrics = trainer.train_step(groups, config)
    sync()
    return {
        "step_s": time.perf_counter() - started,
        "clip_fraction": float(metrics["clip_fraction"]),
        "loss": float(metrics["loss"]),
        "trained_tokens": int(metrics["trained_tokens"]),
        "peak_memory_gb": float(metrics.get("peak_memory_gb", 0.0)),
    }


def check_model(name: str, path: Path, work: Path, groups: int, size: int, new_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {"model": name}
    cuda = torch.cuda.is_available()  # the CPU run (fp32) only checks that the script works
    trainer = Trainer(
        path, LORA, engine="peft", device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else None
    )
    report["load_s"] = trainer.load_seconds
    start = work / f"{name}-start"
    trainer.save(start)
    batch, entropy = sample_groups(trainer, groups, size, new_tokens)
    report["sampled_entropy_nats"] = entropy
    report["gap"] = logprob_gap(trainer, batch)
    report["steps"] = {}
    for loss in ("grpo", "cispo", "gspo"):
        trainer.load(start)
        config = TrainConfig(loss=loss, learning_rate=1e-5)
        timed_step(trainer, batch, config)  # warm-up (kernels, allocator)
        trainer.load(start)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        report["steps"][f"peft/{loss}"] = timed_step(trainer, batch, config)
    del trainer
    if cuda:
        torch.cuda.empty_cache()

    from art_adapters.training.sharded import ShardedTrainer

    try:
        sharded = ShardedTrainer(path, LORA, processes=1, gpu_ids=[0] if cuda else None, engine="peft")
    except Exception as error:  # report, and keep the rest of the check
        report["steps"]["fsdp2x1/grpo"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    else:
        try:
            config = TrainConfig(loss="grpo", learning_rate=1e-5)
            sharded.load(start)
            timed_step(sharded, batch, config)
            sharded.load(start)
            report["steps"]["fsdp2x1/grpo"] = timed_step(sharded, batch, config)
        except Exception as error:
            report["steps"]["fsdp2x1/grpo"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        finally:
            sharded.close()
    report["steps"]["fsdp2x2/grpo"] = two_processes(path, start, batch, work / f"{name}-sharded")
    try:
        import unsloth  # noqa: F401

        report["unsloth"] = "importable"
    except Exception as error:
        report["unsloth"] = f"not available: {type(error).__name__}: {str(error)[:200]}"
    return report


def two_processes(path: Path, start: Path, batch: list[TrajectoryGroup], work: Path) -> dict[str, Any]:
    """The step on 2 processes (GPUs 0 and 1, several micro-batches each) against 1, from the same checkpoint."""
    from safetensors.torch import load_file

    from art_adapters.training.sharded import ShardedTrainer

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) here: the multi-process case needs two"}
    config = TrainConfig(loss="grpo", learning_rate=1e-5, micro_batch_tokens=1024)
    results: dict[int, dict[str, Any]] = {}
    for processes in (1, 2):
        trainer = ShardedTrainer(
            path, LORA, processes=processes, gpu_ids=list(range(processes)), engine="peft"
        )
        try:
            trainer.load(start)
            timed_step(trainer, batch, config)  # warm-up
            trainer.load(start)
            trainer.memory(probe=True)
            step = timed_step(trainer, batch, config)
            step["ranks"] = trainer.memory(probe=False)
            trainer.save(work / str(processes))
            results[processes] = step
        except Exception as error:
            return {"error": f"{processes} processes: {type(error).__name__}: {error}"[:2000]}
        finally:
            trainer.close()
    one, two = (load_file(str(work / str(n) / "adapter_model.safetensors")) for n in (1, 2))
    worst = max(float((one[k].float() - two[k].float()).abs().max()) for k in one)
    step = results[2]
    step["vs_one_process"] = {
        "loss": results[1]["loss"],
        "adapter_max_abs_diff": worst,
        "cuda_peak_gb": [r["cuda_peak_bytes"] / 2**30 for r in results[1]["ranks"]],
        "weights_held_gb": [r["resident_weight_bytes_peak"] / 2**30 for r in results[1]["ranks"]],
    }
    step["peak_memory_gb"] = max(r["cuda_peak_bytes"] for r in step["ranks"]) / 2**30
    step["weights_held_gb"] = [r["resident_weight_bytes_peak"] / 2**30 for r in step["ranks"]]
    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="/tmp/gpu-fidelity")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--tiny-only", action="store_true", help="skip the 0.5B-shaped model (a quick CPU try)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu-fidelity-models")
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    reports = [check_model("tiny", tiny_model_path(), work, args.groups, args.group_size, args.new_tokens)]
    if not args.tiny_only:
        big = build_qwen_shaped(work / "qwen-shaped")
        reports.append(
            check_model("qwen2.5-0.5b-shape", big, work, args.groups, args.group_size, args.new_tokens)
        )
    (out / "gpu_fidelity.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "reports": reports}, indent=2)
    )
    print(
        f"{device}, torch {torch.__version__}, {args.groups}x{args.group_size} trajectories of {args.new_tokens} tokens"
    )
    for report in reports:
        gap = report["gap"]
        print(
            f"\n{report['model']}: entropy {report['sampled_entropy_nats']:.2f} nats; token gap mean "
            f"{gap['mean_abs_token_gap']:.2e} p99 {gap['p99_abs_token_gap']:.2e} max {gap['max_abs_token_gap']:.2e}; "
            f"sequence gap {gap['mean_abs_sequence_gap']:.2e}; GSPO clips {gap['gspo_sequences_outside_clip']:.1%} "
            f"of sequences, GRPO {gap['grpo_tokens_outside_0.2']:.2%} of tokens; unsloth {report['unsloth']}"
        )
        for key, step in report["steps"].items():
            if "error" in step or "skipped" in step:
                print(
                    f"  {key:16s} {'error' if 'error' in step else 'skipped'}: {step.get('error', step.get('skipped'))[:300]}"
                )
                continue
            if "vs_one_process" in step:
                versus = step["vs_one_process"]
                print(f"  {key:16s} vs 1 process: loss {versus['loss']:+.5f}, adapter max |diff| "
                      f"{versus['adapter_max_abs_diff']:.2e}; weights held per process {step['weights_held_gb']} GB "
                      f"(1 process: {versus['weights_held_gb']} GB)")  # fmt: skip
            print(
                f"  {key:16s} step {step['step_s']:.3f} s  peak {step['peak_memory_gb']:.2f} GB  "
                f"clip_fraction {step['clip_fraction']:.4f}  loss {step['loss']:+.5f}  tokens {step['trained_tokens']}"
            )


if __name__ == "__main__":
    main()
