"""Where trainer and engine run: ART's dedicated placement (`trainer_gpu_ids` / `inference_gpu_ids`) reaches the
engine's process and the trainer's device, and a dedicated engine never sleeps during a step; engine settings a
registration asks for apply to a LocalBackend's engine only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.backend.local import LocalBackend
from art_adapters.backend.serving import Registered
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.tiny import tiny_model_path


def dedicated_model(**internal: Any) -> art.TrainableModel:
    return art.TrainableModel(
        name="placed", project="p", base_model=str(tiny_model_path()), _internal_config=internal
    )


def test_arts_placement_reaches_the_engines_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = dedicated_model(trainer_gpu_ids=[0], inference_gpu_ids=[1, 2])
    assert model.trainer_gpu_ids() == [0] and model.inference_settings() == {"gpu_ids": [1, 2]}
    config = LocalBackend(tmp_path)._inference_config(model, 8)
    assert config.gpu_ids == [1, 2]
    server = VLLMServer(tiny_model_path(), config)
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "CUDA_VISIBLE_DEVICES" not in VLLMServer(tiny_model_path(), InferenceConfig()).environment()
    with pytest.raises(art.UnsupportedARTSetting, match="list of GPU indices"):
        dedicated_model(trainer_gpu_ids="0").trainer_gpu_ids()


class SleepRecorder:
    """Stands in for the engine: records sleep/wake calls (CUDA's sleep mode)."""

    def __init__(self, gpu_ids: list[int] | None) -> None:
        self.config = InferenceConfig(gpu_ids=gpu_ids)
        self.calls: list[str] = []

    async def sleep(self) -> None:
        self.calls.append("sleep")

    async def wake_up(self) -> None:
        self.calls.append("wake_up")


class NoTrainer:
    step = 0


@pytest.mark.parametrize(
    ("trainer_gpus", "engine_gpus", "sleeps"),
    [([0], [1], False), ([0], [0], True), ([], [1], True), ([0], None, True)],
)
async def test_a_dedicated_engine_never_sleeps_during_a_step(
    tmp_path: Path, trainer_gpus: list[int], engine_gpus: list[int] | None, sleeps: bool
) -> None:
    import asyncio

    backend = LocalBackend(tmp_path, trainer_gpu_ids=trainer_gpus)
    server = SleepRecorder(engine_gpus)
    state = Registered(
        model=dedicated_model(),
        directory=tmp_path,
        server=server,  # type: ignore[arg-type]
        gateway=None,  # type: ignore[arg-type]
        trainer=NoTrainer(),  # type: ignore[arg-type]
        step=0,
        lock=asyncio.Lock(),
    )
    assert await backend._run_trainer(state, lambda trainer: {"ok": 1}) == {"ok": 1}
    assert server.calls == (["sleep", "wake_up"] if sleeps else [])
    assert backend.dedicated(state) is not sleeps


async def test_engine_settings_of_a_registration_are_the_local_engines_only(tmp_path: Path) -> None:
    model = dedicated_model()
    from art_adapters.compat import openai_client_engine_args

    model._client_engine_args = openai_client_engine_args({"engine_args": {"enforce_eager": True}})
    assert LocalBackend(tmp_path)._inference_config(model, 8).enforce_eager is True
    with pytest.raises(art.RemoteBackendError, match="the server's"):
        await model.register(art.RemoteBackend("http://127.0.0.1:9"), {"engine_args": {"max_num_seqs": 4}})
