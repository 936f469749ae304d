"""Attack on the plan against what LocalBackend builds: on 8 × 80 GB with vLLM given TP 4 × 1 replica, the plan puts
a 16-bit Llama-70B trainer on GPUs 0-3 and budgets each GPU for a quarter of its weights (the sharded trainer's
ranks), but LocalBackend, with no trainer_processes given, builds one process on the first of them: the whole
131 GiB base on one 80 GB card. The plan must budget the trainer that will run, or the backend must run the one
that was planned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters import gpu_memory as mem
from art_adapters.backend import local, stack, trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.gpu_plan import GPUs, ModelShape, make_plan
from art_adapters.inference import InferenceConfig
from test_plan import LLAMA31_8B

LLAMA_70B = {
    **LLAMA31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def test_the_plans_trainer_budget_matches_the_trainer_localbackend_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "llama-70b"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(LLAMA_70B))
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 8)
    monkeypatch.setattr(local, "cuda_devices", lambda: 8)
    monkeypatch.setattr(stack, "check_cuda_stack", lambda: None)
    monkeypatch.setattr(GPUs, "detect", classmethod(lambda cls: GPUs(8, 79.2)))
    backend = LocalBackend(tmp_path / "art", inference=InferenceConfig(tensor_parallel_size=4, replicas=1))
    model = art.TrainableModel(name="m", project="p", base_model=str(base))
    backend._engine_config(base, model, 16)
    plan = backend._base_plans[base]
    assert plan is not None and plan.placement == "dedicated"
    backend._model_plans[backend.model_dir(model)] = plan
    processes = backend._trainer_processes(model)
    whole = mem.trainer_weights_gib(
        ModelShape.from_dict(LLAMA_70B), bytes_per_param=mem.BF16, load_in_4bit=plan.load_in_4bit
    )
    per_process = whole / processes
    assert plan.estimates_gib["trainer_weights"] >= per_process - 0.01, (
        f"plan budgets {plan.estimates_gib['trainer_weights']} GiB of weights per trainer GPU over "
        f"{plan.trainer_gpu_ids}, but LocalBackend runs {processes} process(es): {per_process:.1f} GiB each"
    )


def test_a_sharded_trainer_is_never_planned_with_a_4bit_base() -> None:
    """The sharded trainer (PEFT under FSDP2) refuses load_in_4bit: a plan for one must not choose it."""
    shape = ModelShape.from_dict(LLAMA_70B)
    plan = make_plan(shape, GPUs(8, 79.2), trainer_gpu_ids=[0, 1], inference_gpu_ids=[2, 3, 4, 5, 6, 7])
    assert plan.trainer_gpu_ids == [0, 1] and not plan.load_in_4bit
