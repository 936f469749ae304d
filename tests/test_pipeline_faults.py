"""The async pipeline under ordinary conditions and faults: a finite source ends the run (its last partial batch
trained), a failing stage ends it with that stage's error within moments, evaluation never ends or blocks it,
versions count only what the trained model sampled, and a chaos run always completes or raises, never trains a
group twice, and resumes from the model's state. Every run here is bounded by `wait_for`: a hang fails the test."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.checkpoints import read_history
from art_adapters.pipeline import FutureVersionError, Pipeline, PipelineConfig, train_async
from art_adapters.pipeline_trainer import PipelineTrainer
from pipeline_fakes import Rollouts, TimedBackend

BOUND_S = 20.0  # every run below ends or raises well within this


@pytest.fixture
async def setup(tmp_path: Path) -> tuple[TimedBackend, art.TrainableModel]:
    backend = TimedBackend(tmp_path, step_s=0.01)
    model = art.TrainableModel(name="agent", project="pipe", base_model="tiny")
    await model.register(backend)
    return backend, model


def history(backend: TimedBackend) -> list[dict[str, Any]]:
    return read_history(backend.path / "pipe" / "models" / "agent")


def scenarios_trained(backend: TimedBackend) -> list[int]:
    return [int(g.trajectories[0].metadata["scenario"]) for batch in backend.batches for g in batch]


class Tagged(Rollouts):
    """Rollouts whose trajectories say which scenario they came from."""

    async def __call__(self, model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        group = await super().__call__(model, scenario)
        for trajectory in group.trajectories:
            trajectory.metadata["scenario"] = scenario
        return group


# ---- termination ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("off_policy", [0, 1, 2])
async def test_a_finite_source_trains_its_last_partial_batch_and_returns(
    setup: tuple[TimedBackend, art.TrainableModel], off_policy: int
) -> None:
    backend, model = setup
    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=off_policy)
    reports = await asyncio.wait_for(train_async(model, Tagged(backend), range(5), pipeline=config), BOUND_S)
    assert [len(b) for b in backend.batches] == [2, 2, 1] and [r.step for r in reports] == [1, 2, 3]
    assert sorted(scenarios_trained(backend)) == [0, 1, 2, 3, 4]


async def test_arts_defaults_on_a_finite_list_without_max_steps_return(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    rollouts = Tagged(backend)

    async def rollout_fn(model: art.TrainableModel, scenario: int, config: None) -> art.TrajectoryGroup:
        return await rollouts(model, scenario)

    trainer = PipelineTrainer(model, backend, rollout_fn, list(range(7)), None, eval_fn=None)
    await asyncio.wait_for(trainer.train(handle_signals=False), BOUND_S)
    assert sorted(scenarios_trained(backend)) == list(range(7))  # min_batch_size 4: batches of 4 and 3
    assert [len(b) for b in backend.batches] == [4, 3]


async def test_an_empty_source_trains_nothing(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup
    reports = await asyncio.wait_for(train_async(model, Rollouts(backend), [], pipeline=PipelineConfig()), 5)
    assert reports == [] and backend.batches == []


# ---- failures surface -------------------------------------------------------------------------------------------


def broken_source(after: int) -> Iterator[int]:
    yield from range(after)
    raise ValueError("the dataset's shard 3 is unreadable")


async def test_a_failing_scenario_source_raises_and_releases_every_reservation(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    pipeline = Pipeline(
        model,
        Rollouts(backend),
        broken_source(5),
        pipeline=PipelineConfig(rollout_workers=3, groups_per_step=2),
    )
    with pytest.raises(ValueError, match="shard 3 is unreadable") as raised:
        await asyncio.wait_for(pipeline.run(), BOUND_S)
    assert any("scenario source" in note for note in raised.value.__notes__)
    assert pipeline._outstanding == 0 and pipeline._workers_left == 0


async def test_an_async_source_that_fails_raises(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup

    async def source() -> AsyncIterator[int]:
        yield 1
        raise ConnectionError("the scenario service went away")

    with pytest.raises(ConnectionError, match="went away"):
        await asyncio.wait_for(train_async(model, Rollouts(backend), source()), BOUND_S)


async def test_a_failing_training_step_raises_and_the_run_resumes(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    original = backend.train_events
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(*args, **kwargs)

    backend.train_events = failing  # type: ignore[method-assign]
    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=0)
    rollouts = Tagged(backend)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        await asyncio.wait_for(train_async(model, rollouts, range(100), pipeline=config), BOUND_S)
    assert any("trainer" in note for note in raised.value.__notes__)
    assert backend.step == 2
    reports = await asyncio.wait_for(
        train_async(model, rollouts, range(100), pipeline=config.model_copy(update={"max_steps": 2})), BOUND_S
    )
    assert [r.step for r in reports] == [3, 4]
    trained = scenarios_trained(backend)
    assert len(trained) == len(set(trained)) == 8  # nothing trained twice across the failure


async def test_a_failing_log_raises(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup

    async def broken_log(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise OSError(28, "No space left on device")

    backend.log = broken_log  # type: ignore[method-assign]
    with pytest.raises(OSError, match="No space left"):
        await asyncio.wait_for(train_async(model, Rollouts(backend), range(100)), BOUND_S)


async def test_groups_that_all_failed_raise_after_the_limit(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup

    async def nothing_works(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([], exceptions=[RuntimeError("the tool server is down")])

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_failed_groups=4)
    with pytest.raises(
        RuntimeError, match=r"\d+ rollouts in a row produced no trajectory.*tool server is down"
    ):
        await asyncio.wait_for(train_async(model, nothing_works, range(1000), pipeline=config), BOUND_S)


# ---- evaluation -------------------------------------------------------------------------------------------------


async def test_evaluation_runs_beside_training_and_its_failures_are_logged_not_fatal(
    setup: tuple[TimedBackend, art.TrainableModel], caplog: pytest.LogCaptureFixture
) -> None:
    backend, model = setup
    evaluated: list[tuple[int, int]] = []  # (step evaluated, the backend's step when it ended)

    async def eval_fn(model: art.TrainableModel, step: int) -> Any:
        if step == 2:
            raise RuntimeError("the judge timed out")
        await asyncio.sleep(0.3)  # slower than two steps: training goes on meanwhile
        evaluated.append((step, backend.step))
        return {"val": [art.Trajectory(reward=1.0)], "hard": [art.Trajectory(reward=0.0)]}

    config = PipelineConfig(groups_per_step=2, max_steps=6, eval_every_n_steps=2, eval_at_start=True)
    with caplog.at_level(logging.WARNING, logger="art_adapters.pipeline"):
        pipeline = Pipeline(model, Rollouts(backend), range(1000), pipeline=config, eval_fn=eval_fn)
        await asyncio.wait_for(pipeline.run(), BOUND_S)
    assert [step for step, _ in evaluated] == [0, 4, 6] and pipeline.eval_errors == 1
    assert any(ended > step for step, ended in evaluated[:2])  # the trainer did not wait for them
    assert any("evaluation at step 2 failed" in r.getMessage() for r in caplog.records)
    rows = history(backend)
    assert {r["step"] for r in rows if "val/reward" in r} == {0, 4, 6}
    assert {r["step"] for r in rows if "hard/reward" in r} == {0, 4, 6}  # each split under its own name
    state = model.read_state()["_pipeline_trainer"]  # type: ignore[index]
    assert state["last_eval_step"] == 6 and state["completed_eval_steps"] == [0, 4, 6]


# ---- ART's current main -----------------------------------------------------------------------------------------


async def test_arts_current_runtime_config_and_its_older_keywords(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)

    async def rollout_fn(model: art.TrainableModel, scenario: int, config: None) -> art.TrajectoryGroup:
        return await rollouts(model, scenario)

    runtime = art.PipelineRuntimeConfig(
        num_rollout_workers=3, min_batch_size=2, max_batch_size=3, max_steps_off_policy=1
    )
    trainer = PipelineTrainer(model, backend, rollout_fn, range(100), None, pipeline=runtime, max_steps=3)
    assert trainer.pipeline_config.max_steps_off_policy == 1 and trainer.pipeline_config.batch_cap == 3
    await asyncio.wait_for(trainer.train(handle_signals=False), BOUND_S)
    assert backend.step == 3
    row = history(backend)[-1]
    for name in (
        "discarded/cum/stale_groups",
        "discarded/cum/zero_variance_groups",
        "discarded/step/stale_groups",
        "discarded/rate/stale_groups",
        "time/step_wall_s",
        "time/step_trainer_idle_s",
        "time/step_backend_train_s",
        "offpolicy/token_weighted_policy_age_steps",
        "offpolicy/token_weighted_policy_age_p95_steps",
        "sample_efficiency/freshness_discount",
        "queue/groups_depth",
        "train/steps_off_policy",  # the older names beside them (ART logs sectioned names unprefixed)
        "train/discarded_stale_groups",
    ):
        assert name in row, name
    older = PipelineTrainer(
        model, backend, rollout_fn, [], None, num_rollout_workers=2, min_batch_size=2, max_steps_off_policy=0
    )
    assert older.pipeline_config.max_steps_off_policy == 0 and older.pipeline_config.rollout_workers == 2
    with pytest.raises(ValueError, match="either pipeline="):
        PipelineTrainer(model, backend, rollout_fn, [], None, pipeline=runtime, min_batch_size=2)
    with pytest.raises(ValueError, match="contradicts"):
        PipelineTrainer(model, backend, rollout_fn, [], None, pipeline=runtime, max_steps_off_policy=2)
    beside = PipelineTrainer(  # some ART versions took the bound beside pipeline=
        model,
        backend,
        rollout_fn,
        [],
        None,
        pipeline=art.PipelineRuntimeConfig(min_batch_size=2),
        max_steps_off_policy=3,
    )
    assert beside.pipeline_config.max_steps_off_policy == 3 and beside.pipeline_config.groups_per_step == 2
    with pytest.raises(art.UnsupportedARTSetting, match="unbounded"):
        PipelineTrainer(model, backend, rollout_fn, [], None, max_steps_off_policy=None)
    with pytest.raises(ValueError, match="max_batch_size must be >= min_batch_size"):
        art.PipelineRuntimeConfig(min_batch_size=4, max_batch_size=2)


async def test_zero_variance_groups_are_counted_per_step_and_logged_as_discarded(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    """ART's failsafe counts equal-reward groups since the last trained step: a long healthy run with a few per
    step never trips it (the cumulative count is its own metric); a run of them between two steps does."""
    backend, model = setup
    rollouts = Rollouts(backend)

    async def some_flat(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        group = await rollouts(model, scenario)
        if scenario % 3 == 0:  # one group in three carries no signal
            for trajectory in group.trajectories:
                trajectory.reward = 1.0
        return group

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps=20, max_zero_variance_groups=3)
    pipeline = Pipeline(model, some_flat, range(1000), pipeline=config)
    reports = await asyncio.wait_for(pipeline.run(), BOUND_S)
    assert len(reports) == 20 and not pipeline.collapsed
    assert reports[-1].metrics["discarded/cum/zero_variance_groups"] >= 9 > 3
    assert any(r.get("discarded/reward") == 1.0 for r in history(backend))  # the discarded split

    async def all_flat(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        group = await rollouts(model, scenario)
        for trajectory in group.trajectories:
            trajectory.reward = 0.5
        return group

    collapsing = Pipeline(model, all_flat, range(1000), pipeline=config)
    assert await asyncio.wait_for(collapsing.run(), BOUND_S) == [] and collapsing.collapsed


async def late(backend: TimedBackend, steps: int) -> None:
    """Return only once `steps` more steps have trained (a rollout that comes back too late)."""
    until = backend.step + steps
    while backend.step < until:  # noqa: ASYNC110 - polling the fake backend, bounded by the run's wait_for
        await asyncio.sleep(0.005)


async def test_counters_persist_across_runs(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)

    async def one_late(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        if scenario == 3:  # sampled by this version, back 3 steps later: dropped as stale
            group, _ = await asyncio.gather(rollouts(model, scenario), late(backend, 3))
            return group
        return await rollouts(model, scenario)

    config = PipelineConfig(rollout_workers=3, groups_per_step=2, max_steps_off_policy=1, max_steps=6)
    first = await asyncio.wait_for(train_async(model, one_late, range(1000), pipeline=config), BOUND_S)
    stale = first[-1].metrics["discarded/cum/stale_groups"]
    assert stale == 1
    state = model.read_state()["_pipeline_trainer"]  # type: ignore[index]
    assert state["discarded_stale_groups"] == stale and state["accepted_trainable_groups"] >= 12
    second = await asyncio.wait_for(
        train_async(
            model, Rollouts(backend), range(1000), pipeline=config.model_copy(update={"max_steps": 1})
        ),
        BOUND_S,
    )
    assert second[-1].metrics["discarded/cum/stale_groups"] >= stale  # carried over, not restarted at 0


# ---- versions ---------------------------------------------------------------------------------------------------


async def test_calls_to_a_partner_or_judge_model_do_not_make_groups_stale(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)

    async def with_a_judge(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        group = await rollouts(model, scenario)
        for trajectory in group.trajectories:  # a judge on the same server, far behind (or ahead of) this run
            judge = art.LLMCall(request={}, policy_version=0, served_model="pipe/judge@0")
            future = art.LLMCall(request={}, policy_version=999, served_model="other/agent@999")
            trajectory.llm_calls += [judge, future]
        return group

    config = PipelineConfig(rollout_workers=4, groups_per_step=2, max_steps_off_policy=0, max_steps=6)
    reports = await asyncio.wait_for(train_async(model, with_a_judge, range(1000), pipeline=config), BOUND_S)
    assert len(reports) == 6 and reports[-1].metrics["discarded/cum/stale_groups"] == 0


def choice_of(version: int | None = None, spans: list[dict[str, Any]] | None = None) -> Choice:
    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
    )
    extra: dict[str, Any] = choice.model_extra  # type: ignore[assignment]
    if version is not None:
        extra["policy_version"] = version
    if spans is not None:
        extra["policy_token_spans"] = spans
    return choice


async def test_arts_choice_records_count_and_a_version_from_the_future_is_refused(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    versions: list[int] = []

    async def art_style(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        version = backend.step
        span = {"start_token": 0, "end_token": 3, "policy_version": version, "lora_slot": "pipe/agent@x"}
        trajectories = [
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "q"}, choice_of(spans=[span])], reward=0
            ),
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "q"}, choice_of(version)], reward=1
            ),
        ]
        await (late(backend, 3) if scenario == 0 else asyncio.sleep(0.01))  # scenario 0 comes back too late
        versions.append(version)
        return art.TrajectoryGroup(trajectories)

    config = PipelineConfig(rollout_workers=3, groups_per_step=2, max_steps_off_policy=1, max_steps=5)
    reports = await asyncio.wait_for(train_async(model, art_style, range(1000), pipeline=config), BOUND_S)
    assert reports[-1].metrics["discarded/cum/stale_groups"] >= 1  # the spans said how old scenario 0 was

    async def from_the_future(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        trajectory = art.Trajectory(
            messages_and_choices=[{"role": "user", "content": "q"}, choice_of(backend.step + 7)], reward=1
        )
        return art.TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])

    with pytest.raises(FutureVersionError, match=r"policy version \d+, but the newest version this run has"):
        await asyncio.wait_for(train_async(model, from_the_future, range(1000)), BOUND_S)


async def test_a_trajectorys_own_initial_version_is_the_fallback(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    backend.step = 5

    async def old(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        return art.TrajectoryGroup(
            art.Trajectory(reward=float(r), initial_policy_version=1, final_policy_version=1) for r in (0, 1)
        )

    config = PipelineConfig(groups_per_step=1, max_steps_off_policy=2, max_steps=1, max_failed_groups=1)
    pipeline = Pipeline(model, old, range(50), pipeline=config)
    await asyncio.wait_for(pipeline.run(), 5)
    assert backend.step == 5 and pipeline.discarded_stale_groups == 50  # version 1 < 5 - 2: never trained


async def test_a_shared_gpu_is_warned_about_once(
    setup: tuple[TimedBackend, art.TrainableModel], caplog: pytest.LogCaptureFixture
) -> None:
    backend, model = setup
    backend.rollouts_pause_during_steps = lambda model: True  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="art_adapters.pipeline"):
        await asyncio.wait_for(
            train_async(model, Rollouts(backend), range(100), pipeline=PipelineConfig(max_steps=3)), BOUND_S
        )
    warnings = [r for r in caplog.records if "share a GPU" in r.getMessage()]
    assert len(warnings) == 1 and "rollouts pause" in warnings[0].getMessage()


# ---- chaos ------------------------------------------------------------------------------------------------------


class Chaos(TimedBackend):
    """A backend whose steps and logs fail at random."""

    def __init__(self, path: Path, rng: random.Random) -> None:
        super().__init__(path, step_s=0.005)
        self.rng = rng

    def train_events(self, *args: Any, **kwargs: Any) -> Any:
        if self.rng.random() < 0.08:
            raise RuntimeError("chaos: the training step failed")
        return super().train_events(*args, **kwargs)

    async def log(self, model: art.Model, groups: Any, split: str = "val", **kwargs: Any) -> dict[str, float]:
        if self.rng.random() < 0.04:
            raise OSError("chaos: the history could not be written")
        return await super().log(model, groups, split, **kwargs)


@pytest.mark.parametrize("seed", range(12))
async def test_chaos_every_run_completes_or_raises_and_no_group_trains_twice(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    backend = Chaos(tmp_path, rng)
    model = art.TrainableModel(name="agent", project="pipe", base_model="tiny")
    await model.register(backend)
    total = 40

    def source() -> Iterator[int]:
        for i in range(total):
            if rng.random() < 0.02:
                raise ValueError("chaos: the source failed")
            yield i

    async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        await asyncio.sleep(rng.random() * 0.01)
        if rng.random() < 0.1:
            raise RuntimeError("chaos: the rollout failed")
        rewards = [1.0, 1.0] if rng.random() < 0.1 else [0.0, 1.0]
        served = f"pipe/agent@{backend.step}"
        return art.TrajectoryGroup(
            art.Trajectory(
                reward=r,
                metadata={"scenario": scenario},
                llm_calls=[art.LLMCall(request={}, policy_version=backend.step, served_model=served)],
            )
            for r in rewards
        )

    async def eval_fn(model: art.TrainableModel, step: int) -> list[art.Trajectory]:
        if rng.random() < 0.3:
            raise RuntimeError("chaos: the evaluation failed")
        return [art.Trajectory(reward=1.0)]

    config = PipelineConfig(
        rollout_workers=rng.randint(1, 4),
        groups_per_step=rng.randint(1, 3),
        max_steps_off_policy=rng.randint(0, 2),
        eval_every_n_steps=2,
    )
    outcomes: list[str] = []
    for _ in range(25):  # resume until the source is used up
        try:
            await asyncio.wait_for(
                train_async(model, rollout, source(), pipeline=config, eval_fn=eval_fn), BOUND_S
            )
            outcomes.append("completed")
            break
        except (RuntimeError, OSError, ValueError) as error:
            assert "chaos" in str(error), error
            outcomes.append("raised")
    assert outcomes[-1] == "completed", outcomes
    trained = scenarios_trained(backend)
    assert len(trained) == len(set(trained)), "a group was trained twice"
    state = model.read_state()["_pipeline_trainer"]  # type: ignore[index]
    assert state["training_step"] == backend.step
