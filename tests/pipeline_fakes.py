"""An in-memory backend whose steps take time, and rollouts that sample its current version: the async pipeline's
tests drive the real loop against them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import art_adapters as art
from art_adapters.backend.base import ARTTraining, InferenceEndpoint
from art_adapters.model_log import record_log


class TimedBackend(ARTTraining):
    """Serves `step` as the current version; a step takes `step_s` and records what it trained on."""

    def __init__(self, path: Path, step_s: float = 0.05) -> None:
        self.path = path
        self.step = 0
        self.step_s = step_s
        self.training = False
        self.batches: list[list[art.TrajectoryGroup]] = []
        self.configs: list[art.TrainConfig] = []

    async def register(self, model: art.Model) -> InferenceEndpoint:
        model.base_path = str(self.path)
        return InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="k", model_name=model.name)

    async def get_step(self, model: art.TrainableModel) -> int:
        return self.step

    async def train_events(
        self,
        model: art.TrainableModel,
        groups: list[art.TrajectoryGroup],
        config: art.TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        self.training = True
        try:
            await asyncio.sleep(self.step_s)
        finally:
            self.training = False
        # a step cancelled before here trained nothing (as a backend that drops it)
        self.batches.append(groups)
        self.configs.append(config)
        self.step += 1
        yield {"event": "done", "step": self.step, "metrics": {"loss": 0.1}}

    async def train_sft_events(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError
        yield {}

    async def log(
        self,
        model: art.Model,
        groups: list[art.TrajectoryGroup],
        split: str = "val",
        *,
        metrics=None,
        step=None,
    ) -> dict[str, float]:
        directory = self.path / model.project / "models" / model.name
        return record_log(directory, groups, split, self.step if step is None else step, metrics)

    async def delete_checkpoints(
        self, model: art.TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        return []

    async def close(self) -> None:
        pass


class Rollouts:
    """Group rollouts that sample the backend's current version (as a call through the gateway records it)."""

    def __init__(
        self, backend: TimedBackend, seconds: float = 0.01, slow: dict[int, float] | None = None
    ) -> None:
        self.backend = backend
        self.seconds = seconds
        self.slow = slow or {}
        self.during_training = 0
        self.started = 0

    async def __call__(self, model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        self.started += 1
        self.during_training += self.backend.training
        version = self.backend.step
        await asyncio.sleep(self.slow.get(scenario, self.seconds))
        if scenario < 0:
            raise RuntimeError(f"scenario {scenario} is broken")
        served = f"{model.project}/{model.name}@{version}"  # as the gateway names the version that answered
        calls = [art.LLMCall(request={}, policy_version=version, served_model=served) for _ in range(2)]
        return art.TrajectoryGroup(
            art.Trajectory(llm_calls=[call], reward=float(r + scenario % 3)) for r, call in enumerate(calls)
        )
