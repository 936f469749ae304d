"""The GPU memory plan: parameter counts from config.json, the plans for named machines, refusals with the nearest
plan, bad input before anything loads, GPU detection (a stand-in torch), and the CLI (test_plan_memory.py checks
the formulas against a measurement)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from art_adapters import gpu_memory as mem
from art_adapters.cli import main
from art_adapters.gpu_plan import GPUs, ModelShape, Plan, PlanError, format_plan, make_plan

# The public config.json values (Hugging Face Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen3-8B, Qwen/Qwen2.5-3B-Instruct,
# meta-llama/Llama-3.1-8B), reduced to the keys memory depends on plus a few that must be ignored.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
QWEN25_3B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
LLAMA31_8B = {
    "model_type": "llama",
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
H100 = GPUs(1, 79.2, (9, 0), "H100")
CARD_24GB = GPUs(1, 23.6, (8, 9), "L4")


def write(tmp_path: Path, name: str, config: Any) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    configs = {
        "qwen2.5-7b": QWEN25_7B,
        "qwen3-8b": QWEN3_8B,
        "qwen2.5-3b": QWEN25_3B,
        "llama-3.1-8b": LLAMA31_8B,
    }
    return {name: write(tmp_path, name, config) for name, config in configs.items()}


# --- shapes --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "billions"),
    [("qwen2.5-7b", 7.6156), ("qwen3-8b", 8.1907), ("qwen2.5-3b", 3.0859), ("llama-3.1-8b", 8.0303)],
)
def test_parameter_counts_match_the_published_ones(
    models: dict[str, Path], name: str, billions: float
) -> None:
    shape = ModelShape.from_config(models[name])
    assert shape.parameters / 1e9 == pytest.approx(billions, abs=1e-4)


def test_shape_from_the_file_itself_and_from_a_nested_text_config(
    models: dict[str, Path], tmp_path: Path
) -> None:
    shape = ModelShape.from_config(models["qwen2.5-7b"] / "config.json")
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.context) == (28, 4, 128, 32768)
    nested = write(tmp_path, "vl", {"model_type": "qwen2_5_vl", "text_config": QWEN25_7B})
    assert ModelShape.from_config(nested).parameters == shape.parameters


def test_lora_parameters_r16() -> None:
    shape = ModelShape.from_dict(QWEN25_7B)
    assert mem.lora_parameters(shape, 16) == 40_370_176  # 16·(in + out) over q,k,v,o,gate,up,down × 28 layers
    assert mem.kv_bytes_per_token(shape) == 2 * 28 * 4 * 128 * 2


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not readable as JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({**QWEN25_7B, "hidden_size": None}), "'hidden_size' is missing"),
        (json.dumps({k: v for k, v in QWEN25_7B.items() if k != "vocab_size"}), "'vocab_size' is missing"),
        (
            json.dumps({**QWEN25_7B, "num_hidden_layers": -2}),
            "'num_hidden_layers' must be a positive integer",
        ),
        (
            json.dumps({**QWEN25_7B, "intermediate_size": "big"}),
            "'intermediate_size' must be a positive integer",
        ),
        (json.dumps({**QWEN25_7B, "num_key_value_heads": 5}), "'num_key_value_heads' = 5 does not divide"),
        (
            json.dumps({**QWEN25_7B, "tie_word_embeddings": "no"}),
            "'tie_word_embeddings' must be true or false",
        ),
        (json.dumps({**QWEN3_8B, "num_experts": 128}), "mixture-of-experts"),
    ],
)
def test_an_unreadable_config_names_the_file_and_field(tmp_path: Path, content: str, needle: str) -> None:
    folder = write(tmp_path, "bad", content)
    with pytest.raises(PlanError, match=needle) as caught:
        make_plan(folder, H100)
    assert str(folder / "config.json") in str(caught.value)


def test_a_missing_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such file") as caught:
        make_plan(tmp_path, H100)
    assert str(tmp_path / "config.json") in str(caught.value)


# --- named plans ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b"])
def test_7_to_8b_on_one_80gb_gpu_is_shared_and_fits(models: dict[str, Path], name: str) -> None:
    plan = make_plan(models[name], H100)
    shape = ModelShape.from_config(models[name])
    assert (plan.placement, plan.trainer_gpu_ids, plan.inference_gpu_ids) == ("shared", [0], [0])
    assert plan.enable_sleep_mode and plan.offload_trainer
    assert plan.trainer_dtype == "bfloat16" and not plan.load_in_4bit
    assert plan.max_seq_len == shape.context  # 80 GB holds the whole context with checkpointing
    assert plan.gradient_checkpointing  # a full-context forward without it does not fit
    assert 0.85 <= plan.gpu_memory_utilization <= 0.9
    assert plan.kv_cache_tokens >= 4 * plan.max_seq_len
    e = plan.estimates_gib
    # vLLM's share plus what the offloaded trainer keeps, and the training phase, each within the usable memory
    assert e["inference_phase_total"] <= e["usable"] < H100.memory_gib
    assert e["training_total"] <= e["usable"]
    assert e["trainer_weights"] == pytest.approx(shape.parameters * 2 / 2**30, abs=0.01)
    # the KV tokens follow from the budget: util × memory − weights − overhead, per token's bytes
    budget = plan.gpu_memory_utilization * H100.memory_gib - e["vllm_weights"] - mem.VLLM_OVERHEAD_GIB
    assert plan.kv_cache_tokens == pytest.approx(budget * 2**30 / mem.kv_bytes_per_token(shape), rel=1e-3)


def test_a_shorter_max_seq_len_on_80gb_needs_no_checkpointing(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-7b"], H100, max_seq_len=4096, tokens_per_step=8 * 3584)
    assert plan.max_seq_len == 4096 and not plan.gradient_checkpointing
    assert 4096 <= plan.micro_batch_tokens <= 8 * 3584


def test_3b_on_a_24gb_card_fits_with_checkpointing(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-3b"], CARD_24GB, max_seq_len=8192)
    assert plan.placement == "shared" and plan.trainer_dtype == "bfloat16" and not plan.load_in_4bit
    assert plan.gradient_checkpointing and plan.max_seq_len == 8192
    assert plan.estimates_gib["training_total"] <= plan.estimates_gib["usable"] < 23.6
    assert plan.kv_cache_tokens >= 4 * 8192
    unbounded = make_plan(models["qwen2.5-3b"], CARD_24GB)  # the context capped by what fits
    assert 8192 <= unbounded.max_seq_len <= 32768 and unbounded.max_seq_len % 1024 == 0


def test_7b_on_8_gpus_by_default_trains_on_one_and_serves_on_seven(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-7b"], GPUs(8, 79.2))
    assert plan.placement == "dedicated" and not plan.enable_sleep_mode and not plan.offload_trainer
    assert (plan.trainer_gpu_ids, plan.inference_gpu_ids) == ([0], [1, 2, 3, 4, 5, 6, 7])
    assert (plan.tensor_parallel_size, plan.replicas) == (1, 7)
    assert plan.gpu_memory_utilization == 0.9


def test_7b_on_8_gpus_with_tp_2(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-7b"], GPUs(8, 79.2), tensor_parallel_size=2)
    assert plan.tensor_parallel_size * plan.replicas == len(plan.inference_gpu_ids)
    assert (plan.trainer_gpu_ids, plan.inference_gpu_ids, plan.replicas) == (
        [0],
        [2, 3, 4, 5, 6, 7],
        3,
    )  # one-process trainer
    one = make_plan(models["qwen2.5-7b"], GPUs(8, 79.2))
    assert plan.estimates_gib["vllm_weights"] == pytest.approx(
        one.estimates_gib["vllm_weights"] / 2, abs=0.01
    )
    assert (
        plan.kv_cache_tokens > 2 * one.kv_cache_tokens
    )  # half the weights per GPU, half the KV heads per GPU


def test_qwen3_8b_in_bf16_on_24gb_is_refused_with_the_nearest_plan(models: dict[str, Path]) -> None:
    with pytest.raises(PlanError) as caught:
        make_plan(models["qwen3-8b"], CARD_24GB, load_in_4bit=False, max_seq_len=4096)
    message = str(caught.value)
    assert "needs 22.8 GiB" in message and "of 22.4 GiB usable" in message, message
    nearest = caught.value.nearest
    assert nearest is not None and nearest.load_in_4bit and nearest.max_seq_len == 4096
    assert "Nearest plan that fits: shared, 4-bit trainer, max_seq_len 4096" in message
    assert nearest.estimates_gib["training_total"] <= nearest.estimates_gib["usable"]
    default = make_plan(models["qwen3-8b"], CARD_24GB)  # with no flags, that is the plan
    assert default.model_dump(exclude={"notes"}) == nearest.model_dump(exclude={"notes"})


def test_a_context_that_cannot_fit_is_refused_with_a_shorter_nearest(models: dict[str, Path]) -> None:
    with pytest.raises(PlanError, match="the training step needs 41.9 GiB") as caught:
        make_plan(models["qwen3-8b"], CARD_24GB, max_seq_len=32768)
    assert caught.value.nearest is not None and caught.value.nearest.max_seq_len < 32768


def test_pre_ampere_trains_in_float32(models: dict[str, Path]) -> None:
    """The trainer refuses half precision below capability 8.0 (no loss-scaled fp16 steps), so the plan budgets
    fp32 weights there and never a 4-bit base (it computes in half precision)."""
    plan = make_plan(models["qwen2.5-3b"], GPUs(1, 39.4, (7, 0), "V100"), max_seq_len=4096)
    ampere = make_plan(models["qwen2.5-3b"], GPUs(1, 39.4, (8, 0), "A100"), max_seq_len=4096)
    assert plan.trainer_dtype == "float32" and not plan.loss_scaling and not plan.load_in_4bit
    assert plan.estimates_gib["trainer_weights"] == pytest.approx(2 * ampere.estimates_gib["trainer_weights"])
    assert any("no bf16" in note for note in plan.notes)
    with pytest.raises(PlanError):  # fp32 weights of 3B (11.5 GiB) beside the rest do not fit a T4
        make_plan(models["qwen2.5-3b"], GPUs(1, 14.6, (7, 5), "T4"), max_seq_len=4096, load_in_4bit=False)
    assert make_plan(models["qwen2.5-3b"], CARD_24GB, max_seq_len=4096).trainer_dtype == "bfloat16"


def test_the_cpu_plan(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-3b"], None, max_seq_len=2048)
    assert (plan.placement, plan.trainer_dtype, plan.max_seq_len, plan.gpu_count) == (
        "cpu",
        "float32",
        2048,
        0,
    )
    assert plan.gpu_memory_utilization == 0 and plan.kv_cache_tokens == 0 and not plan.enable_sleep_mode
    assert make_plan(models["qwen2.5-3b"], None).max_seq_len == 32768
    with pytest.raises(PlanError, match="tensor_parallel_size: GPU settings"):
        make_plan(models["qwen2.5-3b"], None, tensor_parallel_size=2)


def test_every_override_is_honoured(models: dict[str, Path]) -> None:
    plan = make_plan(
        models["qwen2.5-7b"],
        GPUs(4, 79.2),
        placement="dedicated",
        trainer_gpu_ids=[3],
        inference_gpu_ids=[0, 1],
        tensor_parallel_size=2,
        gpu_memory_utilization=0.8,
        load_in_4bit=True,
        gradient_checkpointing=True,
        logprob_chunk_tokens=512,
        micro_batch_tokens=2048,
        max_seq_len=8192,
        lora_rank=32,
    )
    assert (plan.trainer_gpu_ids, plan.inference_gpu_ids, plan.tensor_parallel_size, plan.replicas) == (
        [3],
        [0, 1],
        2,
        1,
    )
    assert (plan.gpu_memory_utilization, plan.load_in_4bit, plan.gradient_checkpointing) == (0.8, True, True)
    assert (plan.logprob_chunk_tokens, plan.micro_batch_tokens, plan.max_seq_len) == (512, 2048, 8192)
    r32 = plan.estimates_gib["lora_optimizer"]
    assert r32 == pytest.approx(
        2 * make_plan(models["qwen2.5-7b"], H100).estimates_gib["lora_optimizer"], abs=0.02
    )
    shared = make_plan(models["qwen2.5-7b"], GPUs(2, 79.2), placement="shared")
    assert shared.enable_sleep_mode and shared.inference_gpu_ids == [0] and shared.trainer_gpu_ids == [0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"trainer_gpu_ids": [8]}, r"trainer_gpu_ids \[8\]: each must be a distinct GPU id in 0..7"),
        ({"inference_gpu_ids": [0, 0]}, "distinct GPU id"),
        ({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [1, 2]}, r"overlap on \[1\]"),
        (
            {"inference_gpu_ids": [1, 2, 3, 4, 5, 6, 7], "tensor_parallel_size": 2, "replicas": 2},
            r"2 × 2 ≠ 7",
        ),
        ({"inference_gpu_ids": [1, 2, 3], "tensor_parallel_size": 2}, r"2 × \? ≠ 3"),
        (
            {"tensor_parallel_size": 3, "inference_gpu_ids": [1, 2, 3]},
            "must divide the model's 28 attention heads",
        ),
        ({"gpu_memory_utilization": 1.2}, "between 0 and 1"),
        ({"gpu_memory_utilization": 0.0}, "between 0 and 1"),
        ({"max_seq_len": 65536}, "exceeds .* context \\(32768"),
        ({"lora_rank": 0}, "lora_rank must be a positive integer"),
        (
            {"placement": "shared", "trainer_gpu_ids": [1], "inference_gpu_ids": [0]},
            "must be among the inference",
        ),
    ],
)
def test_bad_settings_are_refused_before_anything_loads(
    models: dict[str, Path], kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(PlanError, match=needle):
        make_plan(models["qwen2.5-7b"], GPUs(8, 79.2), **kwargs)


def test_dedicated_on_one_gpu_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(PlanError, match="dedicated' needs at least 2 GPUs"):
        make_plan(models["qwen2.5-7b"], H100, placement="dedicated")


def test_the_table_shows_each_decision_beside_the_memory(models: dict[str, Path]) -> None:
    plan = make_plan(models["qwen2.5-7b"], GPUs(8, 79.2, name="H100"), tensor_parallel_size=2)
    table = format_plan(plan)
    for text in (
        "dedicated",
        "2-7",
        "2 × 3",
        "0.9",
        "KV cache tokens",
        f"{plan.kv_cache_tokens:,}",
        "of 79.2",
    ):
        assert text in table, text
    assert f"{plan.estimates_gib['training_total']:>7.2f}" in table
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


# --- GPU detection (a stand-in torch) ------------------------------------------------------------------------------


def fake_torch(monkeypatch: pytest.MonkeyPatch, devices: list[tuple[str, int, tuple[int, int]]]) -> None:
    props = [types.SimpleNamespace(name=n, total_memory=m, major=c[0], minor=c[1]) for n, m, c in devices]
    cuda = types.SimpleNamespace(
        is_available=lambda: bool(devices),
        device_count=lambda: len(devices),
        get_device_properties=lambda i: props[i],
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


def test_detect_none_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, [])
    assert GPUs.detect() is None
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
    assert GPUs.detect() is None


def test_detect_takes_the_smallest_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch numbers the GPUs CUDA_VISIBLE_DEVICES leaves 0..n-1: the plan's ids are those logical ids
    fake_torch(monkeypatch, [("H100", 85 * 2**30, (9, 0)), ("A10", 24 * 2**30, (8, 6))])
    assert GPUs.detect() == GPUs(2, 24.0, (8, 6), "A10")


# --- the CLI -------------------------------------------------------------------------------------------------------


def test_cli_prints_the_table_and_json(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(models["qwen2.5-7b"]), "--gpus", "1", "--gpu-memory", "79.2"]) == 0
    assert "shared" in capsys.readouterr().out
    argv = [
        "plan",
        str(models["qwen2.5-7b"]),
        "--gpus",
        "8",
        "--gpu-memory",
        "79.2",
        "--tensor-parallel-size",
        "2",
    ]
    assert main([*argv, "--json"]) == 0
    plan = Plan.model_validate_json(capsys.readouterr().out)
    assert (plan.tensor_parallel_size, plan.replicas, plan.trainer_gpu_ids) == (2, 3, [0])
    assert main(["plan", str(models["qwen2.5-3b"]), "--gpus", "0", "--max-seq-len", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"] == "cpu"


def test_cli_refusal_exits_2_with_the_nearest_plan(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", str(models["qwen3-8b"]), "--gpus", "1", "--gpu-memory", "23.6", "--capability", "8.9"]
    assert main([*argv, "--load-in-4bit", "off", "--max-seq-len", "4096"]) == 2
    out, err = capsys.readouterr()
    assert (
        "does not fit on 1 × 23.6 GiB" in err and "The nearest plan that fits" in out and "4-bit base" in out
    )
    assert main([*argv, "--load-in-4bit", "off", "--max-seq-len", "4096", "--json"]) == 2
    refused = json.loads(capsys.readouterr().out)
    assert "does not fit" in refused["error"] and refused["nearest"]["load_in_4bit"] is True


def test_cli_bad_input(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path / "absent"), "--gpus", "1", "--gpu-memory", "80"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(models["qwen2.5-7b"]), "--gpus", "2"])
    assert exited.value.code == 2 and "--gpus needs --gpu-memory" in capsys.readouterr().err


def test_a_hub_name_fetches_only_its_config(
    monkeypatch: pytest.MonkeyPatch, models: dict[str, Path], tmp_path: Path
) -> None:
    import huggingface_hub

    asked: list[tuple[str, str]] = []

    def download(repo_id: str, filename: str) -> str:
        asked.append((repo_id, filename))
        if repo_id == "Qwen/Absent":
            raise OSError("404 for Qwen/Absent")
        return str(models["qwen2.5-7b"] / "config.json")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.chdir(tmp_path)
    assert make_plan("Qwen/Qwen2.5-7B-Instruct", H100).model == "Qwen/Qwen2.5-7B-Instruct"
    with pytest.raises(
        PlanError, match="Qwen/Absent: no such folder, and its config.json could not be fetched"
    ):
        make_plan("Qwen/Absent", H100)
    assert asked == [("Qwen/Qwen2.5-7B-Instruct", "config.json"), ("Qwen/Absent", "config.json")]
