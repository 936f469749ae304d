"""Attack on explicit settings against the plan: `enable_sleep_mode=False` where the trainer shares the engine's GPU
is accepted but cannot work (the engine's sleep becomes a logged no-op, and the trainer reloads beside an engine
that holds ~90% of the card). It must be refused before anything loads, naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.backend import local, stack, trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.gpu_plan import GPUs
from art_adapters.inference import InferenceConfig
from art_adapters.tiny import tiny_model_path


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 1)
    monkeypatch.setattr(local, "cuda_devices", lambda: 1)
    monkeypatch.setattr(stack, "check_cuda_stack", lambda: None)
    monkeypatch.setattr(GPUs, "detect", classmethod(lambda cls: GPUs(1, 79.2)))


def model() -> art.TrainableModel:
    return art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))


def test_sleep_mode_off_on_a_shared_gpu_is_refused(tmp_path: Path, one_gpu: None) -> None:
    backend = LocalBackend(tmp_path, inference=InferenceConfig(enable_sleep_mode=False))
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        backend._engine_config(tiny_model_path(), model(), 16)


def test_sleep_mode_on_a_shared_gpu_is_planned(tmp_path: Path, one_gpu: None) -> None:
    config = LocalBackend(tmp_path)._engine_config(tiny_model_path(), model(), 16)
    assert config.sleep_mode_enabled(True) is True
