"""The async pipeline's faults on the real LocalBackend (shared vLLM server, tiny model): a step whose caller is
cancelled mid-step (a run ending on another stage's error) leaves the next step intact, and a run whose engine is
killed mid-run completes once the gateway has restarted it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from art_adapters.pipeline import PipelineConfig, StepReport, train_async
from fixtures_vllm import registered_on, sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train, pytest.mark.asyncio(loop_scope="session")]


async def test_a_step_cancelled_mid_way_leaves_the_next_step_intact(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="cancelled", project="pipeline") as (backend, model):
        first = await sampled_group(model, [1.0, 0.0, 1.0, 0.0], "Name a colour")
        await backend.train(model, [first], learning_rate=1e-3, loss_fn="ppo")
        trainer = backend._registered(model).trainer
        assert trainer is not None
        started = threading.Event()
        original = trainer.train_step

        def slow_step(*args: Any, **kwargs: Any) -> Any:
            started.set()
            time.sleep(1.0)  # long enough to be cancelled in the middle
            return original(*args, **kwargs)

        trainer.train_step = slow_step  # type: ignore[method-assign]
        step = await model.get_step()
        group = await sampled_group(model, [0.0, 1.0, 0.0, 1.0], "Name a fruit")
        stepping = asyncio.create_task(backend.train(model, [group], learning_rate=1e-3, loss_fn="ppo"))
        assert await asyncio.to_thread(started.wait, 60)
        stepping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stepping
        assert await model.get_step() == step  # the cancelled update is in no checkpoint, and not served
        result = await backend.train(model, [group], learning_rate=1e-3, loss_fn="ppo")
        assert result.step == step + 1 and result.metrics["trained_tokens"] > 0
        ids = group.trajectories[1].messages_and_choices[-1].model_extra["prompt_token_ids"]  # type: ignore[union-attr]
        assert (
            await backend.served_logprob_diff(model, ids) <= 1e-4
        )  # what vLLM serves is what the trainer holds


async def test_a_run_whose_engine_is_killed_mid_run_completes(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="phoenix", project="pipeline") as (backend, model):

        async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
            return await sampled_group(model, [1.0, 0.0, 0.5], f"Count to {scenario}", max_tokens=4)

        restarts = vllm_server.restarts

        async def kill_after_first(report: StepReport, batch: list[art.TrajectoryGroup]) -> None:
            if report.step == 1:
                assert vllm_server.process is not None
                os.kill(vllm_server.process.pid, signal.SIGKILL)

        config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps=3, max_failed_groups=100)
        reports = await asyncio.wait_for(
            train_async(
                model,
                rollout,
                range(1000),
                config=art.TrainConfig(learning_rate=1e-3),
                pipeline=config,
                on_step=kill_after_first,
            ),
            900,
        )
        assert [r.step for r in reports] == [1, 2, 3] and vllm_server.restarts == restarts + 1
        assert vllm_server.running and "pipeline/phoenix@3" in vllm_server.loras
