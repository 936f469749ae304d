"""The async pipeline's logic against an in-memory backend whose steps take time: rollouts keep running while a
step trains, staleness stays within its bound (dropped beyond it), failures never end a run, a killed run resumes,
and ART's PipelineTrainer face drives the same loop with ART's knobs and metric names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.pipeline import Pipeline, PipelineConfig, train_async
from art_adapters.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from pipeline_fakes import Rollouts, TimedBackend


@pytest.fixture
async def setup(tmp_path: Path) -> tuple[TimedBackend, art.TrainableModel]:
    backend = TimedBackend(tmp_path)
    model = art.TrainableModel(name="agent", project="pipe", base_model="tiny")
    await model.register(backend)
    return backend, model


async def until(condition: Any) -> None:
    while not condition():  # noqa: ASYNC110 - polling state another task changes, bounded by the test timeout
        await asyncio.sleep(0.005)


def trained_staleness(backend: TimedBackend) -> list[int]:
    """For every trained group: the step it trained into minus one, minus the version that sampled it."""
    return [
        step - min(t.initial_policy_version for t in group.trajectories)  # type: ignore[type-var]
        for step, batch in enumerate(backend.batches)
        for group in batch
    ]


async def test_zero_staleness_is_the_synchronous_loop(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)
    config = PipelineConfig(rollout_workers=4, groups_per_step=2, max_steps_off_policy=0, max_steps=5)
    reports = await train_async(model, rollouts, range(1000), pipeline=config)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5] and [len(b) for b in backend.batches] == [2] * 5
    assert trained_staleness(backend) == [0] * 10 and rollouts.during_training == 0
    assert all(
        r.metrics["discarded_stale_groups"] == 0 and r.metrics["steps_off_policy"] == 0 for r in reports
    )


async def test_rollouts_keep_running_while_a_step_trains(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    backend.step_s = 0.2
    rollouts = Rollouts(backend, seconds=0.02)
    config = PipelineConfig(rollout_workers=4, groups_per_step=4, max_steps_off_policy=1, max_steps=4)
    reports = await train_async(model, rollouts, range(1000), pipeline=config)
    assert rollouts.during_training >= 4  # rollouts started while steps trained
    staleness = trained_staleness(backend)
    assert max(staleness) == 1 and min(staleness) == 0  # off-policy by one step at most, and used
    assert all(r.metrics["discarded_stale_groups"] == 0 for r in reports)
    history = [
        json.loads(line)
        for line in (backend.path / "pipe/models/agent/history.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in history] == [1, 2, 3, 4]
    assert {"train/steps_off_policy", "train/discarded_stale_groups", "train/reward", "train/loss"} <= set(
        history[-1]
    )


async def test_groups_older_than_the_bound_are_dropped_and_counted(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    backend.step_s = 0.1
    rollouts = Rollouts(backend, seconds=0.01, slow={0: 0.35})  # scenario 0 returns three steps later
    config = PipelineConfig(rollout_workers=3, groups_per_step=2, max_steps_off_policy=1, max_steps=8)
    reports = await train_async(model, rollouts, range(1000), pipeline=config)
    assert reports[-1].metrics["discarded_stale_groups"] >= 1
    assert max(trained_staleness(backend)) <= 1


async def test_failing_rollouts_never_end_the_run(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup
    scenarios = [-1 if i % 3 == 0 else i for i in range(60)]
    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps=5)
    reports = await train_async(model, Rollouts(backend), scenarios, pipeline=config)
    assert len(reports) == 5 and reports[-1].metrics["rollout_errors"] >= 3


async def test_a_killed_run_resumes_where_its_last_step_left_it(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    backend.step_s = 0.1
    seen: list[int] = []
    rollouts = Rollouts(backend)

    async def recording(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        seen.append(scenario)
        return await rollouts(model, scenario)

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=0)
    run = asyncio.create_task(train_async(model, recording, range(1000), pipeline=config))
    await until(lambda: backend.step >= 2 and backend.training)  # kill it in the middle of its third step
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    state = model.read_state()
    assert state is not None and state["_pipeline_trainer"]["training_step"] == 2
    offset = state["_pipeline_trainer"]["offsets"][str(backend.step)]  # the step the backend holds now
    assert offset >= 4 and backend.step in (2, 3)
    resumed: list[int] = []

    async def after(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        resumed.append(scenario)
        return await rollouts(model, scenario)

    start = backend.step
    reports = await train_async(
        model, after, range(1000), pipeline=config.model_copy(update={"max_steps": 2})
    )
    assert [r.step for r in reports] == [start + 1, start + 2]
    assert min(resumed) == offset  # no scenario trained twice, none before the offset re-run


async def test_a_step_whose_checkpoint_outlived_its_log_row_is_marked_lost_on_resume(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    """Killed after a step's checkpoint was saved but before its history row was written: the resumed run writes
    that step's row, saying its metrics were lost, so history has every step the checkpoints have."""
    from art_adapters.checkpoints import read_history

    backend, model = setup
    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=0, max_steps=2)
    await train_async(model, Rollouts(backend), range(1000), pipeline=config)
    backend.step += 1  # step 3's checkpoint exists; its run died before logging it
    await train_async(
        model, Rollouts(backend), range(1000), pipeline=config.model_copy(update={"max_steps": 1})
    )
    rows = [r for r in read_history(backend.path / "pipe" / "models" / "agent") if r.get("split") == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("train/metrics_lost_in_crash") for r in rows] == [None, None, 1.0, None]
    # killed after step 5's row was written but before the state said so: no second row for it
    await train_async(
        model, Rollouts(backend), range(1000), pipeline=config.model_copy(update={"max_steps": 1})
    )
    model.merge_state({"_pipeline_trainer": {"training_step": 4}})
    await train_async(
        model, Rollouts(backend), range(1000), pipeline=config.model_copy(update={"max_steps": 1})
    )
    rows = [r for r in read_history(backend.path / "pipe" / "models" / "agent") if r.get("split") == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


async def test_art_pipeline_trainer_drives_the_same_loop(
    setup: tuple[TimedBackend, art.TrainableModel], tmp_path: Path
) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)
    evaluated: list[int] = []

    async def rollout_fn(
        model: art.TrainableModel, scenario: dict[str, int], config: None
    ) -> art.TrajectoryGroup:
        return await rollouts(model, scenario["n"])

    async def eval_fn(model: art.TrainableModel, step: int, config: None) -> list[art.Trajectory]:
        evaluated.append(step)
        return [art.Trajectory(reward=1.0)]

    trainer = PipelineTrainer(
        model=model,
        backend=backend,
        rollout_fn=rollout_fn,
        scenarios=({"n": i} for i in range(100)),
        config=None,
        learning_rate=5e-5,
        loss_fn="cispo",
        eval_fn=eval_fn,
        max_steps=4,
        eval_every_n_steps=2,
        eval_at_start=False,
        total_scenarios=None,
        min_batch_size=2,
        num_rollout_workers=3,
    )
    await trainer.train()
    assert backend.step == 4 and evaluated == [2, 4]
    config = backend.configs[-1]
    assert (config.loss, config.learning_rate) == ("cispo", 5e-5)
    # ART's PipelineTrainer trains exact tokens only (TokenFlag.EXACT): never re-rendered text
    assert not config.train_retokenized_text
    history = (backend.path / "pipe/models/agent/history.jsonl").read_text()
    assert '"train/steps_off_policy"' in history and '"val/reward"' in history
    with pytest.raises(art.UnsupportedARTSetting, match="adam_params"):
        PipelineTrainer(model, backend, rollout_fn, [], None, adam_params=object())
    with pytest.raises(art.UnsupportedARTSetting, match="grad_accumulation_sequences"):
        PipelineTrainer(model, backend, rollout_fn, [], None, grad_accumulation_sequences=4)
    with pytest.raises(TypeError, match="unexpected keyword"):
        PipelineTrainer(model, backend, rollout_fn, [], None, no_such_knob=1)

    async def single(model: art.TrainableModel, scenario: Any, config: Any) -> art.Trajectory:
        if scenario == "bad":
            raise ValueError("bad")
        return art.Trajectory(reward=1.0)

    group = await make_group_rollout_fn(single, n=3)(model, "ok", None)
    assert len(group.trajectories) == 3
    assert len((await make_group_rollout_fn(single, n=2)(model, "bad", None)).exceptions) == 2


async def test_a_pipeline_can_be_stopped_between_steps(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    pipeline = Pipeline(model, Rollouts(backend), range(1000), pipeline=PipelineConfig(groups_per_step=2))
    run = asyncio.create_task(pipeline.run())
    await until(lambda: backend.step >= 2)
    pipeline.stop()
    reports = await asyncio.wait_for(run, 10)
    assert reports and reports[-1].step == backend.step
