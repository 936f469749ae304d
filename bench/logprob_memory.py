"""Peak memory of the trainer's logprobs (forward + backward) with and without position chunks, CPU fp32, on the tiny
model with Qwen's 151,936-entry vocabulary: each setting in its own subprocess (peak RSS above the loaded trainer,
and the bytes autograd saves for backward), reported as ratios against the unchunked run of the same invocation.

Usage: `python bench/logprob_memory.py [--positions 2048] [--chunks 0,1024,256]` (0: unchunked)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any


def child(positions: int, chunk: int) -> dict[str, Any]:
    """One forward + backward of `positions` trained positions; memory measured around the second (warm) one."""
    from art_adapters.training.quiet import quiet_import_notes

    quiet_import_notes()
    import psutil
    import torch

    from art_adapters.config import LoRAConfig
    from art_adapters.tiny import tiny_model_path
    from art_adapters.training.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(
        tiny_model_path(family="qwen2.5"),
        LoRAConfig(rank=8),
        engine="peft",
        max_seq_len=positions + 1,
        logprob_chunk_tokens=chunk,
    )
    vocab = trainer.model.get_base_model().config.vocab_size
    row = torch.randint(3, vocab, (positions + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    targets = [list(range(1, positions + 1))]
    trainer.model.train()

    def run() -> tuple[torch.Tensor, float]:
        trainer.model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        values = trainer._token_logprobs([row], targets, [0.8])
        values.sum().backward()
        return values.detach(), time.perf_counter() - started

    small = trainer._token_logprobs([row[:9]], [list(range(1, 9))], [1.0])  # warm up kernels, allocator
    small.sum().backward()
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rss_before = psutil.Process().memory_info().rss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        values, seconds = run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    grad_sum = float(sum(p.grad.double().abs().sum() for p in trainer.params if p.grad is not None))
    return {
        "chunk": chunk,
        "positions": positions,
        "vocab": vocab,
        "peak_rss_above_loaded_mib": (peak - rss_before) / 2**20,
        "saved_for_backward_mib": sum(saved.values()) / 2**20,
        "largest_saved_mib": max(saved.values(), default=0) / 2**20,
        "seconds": seconds,
        "logprob_sum": float(values.double().sum()),
        "grad_abs_sum": grad_sum,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--chunks", default="0,1024,256")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.positions, args.child)))
        return
    from art_adapters.tiny import tiny_model_path

    tiny_model_path(family="qwen2.5")  # built once, outside the measured processes
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        out = subprocess.run(
            [sys.executable, __file__, f"--positions={args.positions}", f"--child={chunk}"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{args.positions} positions x {base['vocab']:,} vocabulary, CPU fp32, forward + backward")
    print(
        "| chunk | peak RSS above loaded MiB | ratio | saved for backward MiB | ratio | largest saved MiB | s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['chunk'] or 'none'} | {row['peak_rss_above_loaded_mib']:.0f} | "
            f"{row['peak_rss_above_loaded_mib'] / base['peak_rss_above_loaded_mib']:.3f} | "
            f"{row['saved_for_backward_mib']:.0f} | {row['saved_for_backward_mib'] / base['saved_for_backward_mib']:.3f} | "
            f"{row['largest_saved_mib']:.1f} | {row['seconds']:.2f} |"
        )
    for row in rows[1:]:
        print(
            f"chunk {row['chunk']}: logprob sum differs by {abs(row['logprob_sum'] - base['logprob_sum']):.2e}, "
            f"gradient |sum| by {abs(row['grad_abs_sum'] - base['grad_abs_sum']) / base['grad_abs_sum']:.2e} (relative)"
        )


if __name__ == "__main__":
    main()
