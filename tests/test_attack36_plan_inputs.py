"""Attack on issue 36's plan: a GPU memory that is not a finite number (NaN, inf) gets a clear refusal naming it,
not a traceback from the KV-cache arithmetic; a MoE config whose expert count is written as a float is still
refused as MoE rather than planned as a dense model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_adapters.cli import main
from art_adapters.gpu_plan import GPUs, ModelShape, PlanError, make_plan
from test_plan import QWEN3_8B


def folder(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("memory", ["nan", "inf", "-inf"])
def test_cli_refuses_a_gpu_memory_that_is_not_finite(
    tmp_path: Path, memory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = folder(tmp_path, QWEN3_8B)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(model), "--gpus", "1", "--gpu-memory", memory])
    assert exit_info.value.code == 2
    assert "--gpu-memory" in capsys.readouterr().err


@pytest.mark.parametrize("memory", [float("nan"), float("inf")])
def test_make_plan_refuses_gpus_whose_memory_is_not_finite(tmp_path: Path, memory: float) -> None:
    with pytest.raises(PlanError, match="memory"):
        make_plan(ModelShape.from_dict(QWEN3_8B), GPUs(1, memory))


def test_a_float_expert_count_is_still_a_mixture_of_experts() -> None:
    with pytest.raises(PlanError, match="mixture-of-experts"):
        ModelShape.from_dict({**QWEN3_8B, "num_experts": 128.0})


@pytest.mark.parametrize("key", ["tensor_parallel_size", "replicas"])
def test_a_bool_is_not_a_gpu_count(key: str) -> None:
    with pytest.raises(PlanError, match=key):
        make_plan(ModelShape.from_dict(QWEN3_8B), GPUs(8, 79.2), **{key: True})
