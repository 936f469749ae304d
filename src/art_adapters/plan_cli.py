"""`art-adapters plan BASE_MODEL`: print the GPU memory plan (gpu_plan.py) for a model folder holding only
config.json, on the GPUs given or detected; a plan that cannot fit exits 2 with its numbers and the nearest one."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .gpu_plan import GPUs, PlanError, format_plan, make_plan


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _capability(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        raise argparse.ArgumentTypeError(f"a compute capability like 8.0 or 9.0, got {text!r}")
    return int(major), int(minor or 0)


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"on or off, got {text!r}")
    return text == "on"


def plan_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="art-adapters plan", description=__doc__)
    parser.add_argument(
        "base_model", help="a model folder (config.json is enough), a config.json, or a hub name"
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="how many GPUs (default: detect; 0: the CPU plan)"
    )
    parser.add_argument(
        "--gpu-memory", type=float, default=None, help="each GPU's memory in GiB (with --gpus)"
    )
    parser.add_argument(
        "--capability", type=_capability, default=(9, 0), help="compute capability (default 9.0)"
    )
    parser.add_argument(
        "--max-seq-len", type=_positive, default=None, help="default: the model's context, capped"
    )
    parser.add_argument("--lora-rank", type=_positive, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--tokens-per-step", type=_positive, default=None, help="tokens in one RL step")
    parser.add_argument("--micro-batch-tokens", type=_positive, default=None, help="override the plan's")
    parser.add_argument("--tensor-parallel-size", type=_positive, default=None, help="vLLM's TP per replica")
    parser.add_argument("--replicas", type=_positive, default=None, help="vLLM replicas (TP × replicas GPUs)")
    parser.add_argument("--placement", choices=["shared", "dedicated", "cpu"], default=None)
    parser.add_argument(
        "--load-in-4bit", type=_on_off, default=None, metavar="on|off", help="the trainer's base"
    )
    parser.add_argument("--gradient-checkpointing", type=_on_off, default=None, metavar="on|off")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        parser.error(f"--gpus must be 0 or more, got {args.gpus}")
    if args.gpus and args.gpu_memory is None:
        parser.error("--gpus needs --gpu-memory (each GPU's memory in GiB, e.g. 79.2 for an 80 GB H100)")
    if args.gpu_memory is not None and not args.gpus:
        parser.error("--gpu-memory needs --gpus N (N > 0)")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        parser.error(f"--gpu-memory must be a finite number of GiB above 0, got {args.gpu_memory}")
    if args.gpus is None:
        gpus = GPUs.detect()
    elif args.gpus == 0:
        gpus = None
    else:
        gpus = GPUs(args.gpus, args.gpu_memory, args.capability)
    try:
        plan = make_plan(
            args.base_model,
            gpus,
            max_seq_len=args.max_seq_len,
            lora_rank=args.lora_rank,
            tokens_per_step=args.tokens_per_step,
            micro_batch_tokens=args.micro_batch_tokens,
            placement=args.placement,
            tensor_parallel_size=args.tensor_parallel_size,
            replicas=args.replicas,
            load_in_4bit=args.load_in_4bit,
            gradient_checkpointing=args.gradient_checkpointing,
        )
    except PlanError as error:
        if args.json:
            nearest = error.nearest.model_dump() if error.nearest else None
            print(json.dumps({"error": str(error), "nearest": nearest}, indent=2))
        else:
            print(f"art-adapters plan: {error}", file=sys.stderr)
            if error.nearest is not None:
                print("\nThe nearest plan that fits:\n\n" + format_plan(error.nearest))
        return 2
    print(plan.model_dump_json(indent=2) if args.json else format_plan(plan))
    return 0
