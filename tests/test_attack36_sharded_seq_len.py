"""Attack on "one sequence length": with a sharded trainer (trainer GPUs given), LocalBackend built ShardedTrainer
without `max_seq_len`, so it kept its 2048 default while vLLM served the plan's (or the user's) max_model_len:
every rollout longer than 2048 tokens was skipped as too long. The engine's length, and the plan's logprob chunk,
must reach the sharded trainer as they reach the one-process one."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.backend import trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.gpu_plan import Plan
from art_adapters.tiny import tiny_model_path

PLAN = Plan(
    model="m",
    placement="dedicated",
    gpu_count=4,
    gpu_memory_gib=79.2,
    trainer_gpu_ids=[0, 1],
    inference_gpu_ids=[2, 3],
    replicas=2,
    gpu_memory_utilization=0.9,
    max_seq_len=16384,
    gradient_checkpointing=True,
    logprob_chunk_tokens=256,
)


def test_the_sharded_trainer_gets_the_engines_max_seq_len(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []

    class Sharded:
        def __init__(self, base: str, lora: Any, **kwargs: Any) -> None:
            made.append(kwargs)
            self.step = 0

        def save(self, directory: Path) -> Path:
            (directory / "adapter_config.json").write_text("{}")
            return directory

        def close(self) -> None: ...

    monkeypatch.setitem(
        sys.modules, "art_adapters.training.sharded", types.SimpleNamespace(ShardedTrainer=Sharded)
    )
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 4)
    backend = LocalBackend(tmp_path / "art", trainer_gpu_ids=[0, 1])
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))
    directory = backend.model_dir(model)
    directory.mkdir(parents=True, exist_ok=True)
    backend._model_plans[directory] = PLAN
    backend._model_max_len[directory] = 16384
    backend._load_trainer(model, directory)
    assert made and made[0].get("max_seq_len") == 16384, made
    assert made[0].get("logprob_chunk_tokens") == 256, made
