"""What an outside attacker found in the async pipeline and the gateway's version table, each kept fixed: rollouts
that fail at once (raise, return None or an empty group) end the run with their error instead of spinning the event
loop forever; a CancelledError leaking out of a rollout or an evaluation is a failure like any, not a silent end;
`stop()` ends a run that is only waiting for evaluations, and a hung evaluation is bounded; resume skips exactly
what was consumed even when scenarios are None; a partner model's Choice never counts as the trained model's; a
request for one version never waits on another version's load. Every run is bounded by `wait_for`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.inference.versions import VersionTable
from art_adapters.pipeline import Pipeline, PipelineConfig, train_async
from pipeline_fakes import Rollouts, TimedBackend

BOUND_S = 20.0


@pytest.fixture
async def setup(tmp_path: Path) -> tuple[TimedBackend, art.TrainableModel]:
    backend = TimedBackend(tmp_path, step_s=0.01)
    model = art.TrainableModel(name="agent", project="pipe", base_model="tiny")
    await model.register(backend)
    return backend, model


def endless() -> Any:
    n = 0
    while True:
        yield n
        n += 1


@pytest.mark.parametrize("how", ["raises", "none", "wrong type", "empty group", "raises after awaiting"])
async def test_rollouts_that_always_fail_end_the_run_with_their_error(
    setup: tuple[TimedBackend, art.TrainableModel], how: str
) -> None:
    backend, model = setup

    async def failing(model: art.TrainableModel, scenario: int) -> Any:
        if how == "raises after awaiting":
            await asyncio.sleep(0)
        if how.startswith("raises"):
            raise ConnectionError("tool server down")
        return {"none": None, "wrong type": [], "empty group": art.TrajectoryGroup([])}[how]

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_failed_groups=4)
    with pytest.raises(RuntimeError, match=r"\d+ rollouts in a row produced no trajectory"):
        await asyncio.wait_for(train_async(model, failing, endless(), pipeline=config), BOUND_S)
    assert backend.step == 0


async def test_a_cancellation_leaking_out_of_a_rollout_is_a_failure_not_the_end(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    rollouts = Rollouts(backend)

    async def flaky(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        if scenario in (3, 7):
            raise asyncio.CancelledError  # an inner task's or timeout helper's cancellation escaping
        return await rollouts(model, scenario)

    config = PipelineConfig(rollout_workers=2, groups_per_step=2)
    pipeline = Pipeline(model, flaky, range(20), pipeline=config)
    await asyncio.wait_for(pipeline.run(), BOUND_S)
    assert sum(len(batch) for batch in backend.batches) == 18 and pipeline.state.rollout_errors == 2


async def test_stop_ends_a_run_waiting_only_for_a_hung_evaluation(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    hung = asyncio.Event()

    async def eval_fn(model: art.TrainableModel, step: int) -> None:
        hung.set()
        await asyncio.Event().wait()  # never returns

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps=2, eval_every_n_steps=1)
    pipeline = Pipeline(model, Rollouts(backend), endless(), pipeline=config, eval_fn=eval_fn)
    run = asyncio.create_task(pipeline.run())
    await asyncio.wait_for(hung.wait(), BOUND_S)
    await asyncio.sleep(0.2)  # training ends (max_steps) while the evaluation hangs
    pipeline.stop()
    reports = await asyncio.wait_for(run, BOUND_S)
    assert len(reports) == 2


async def test_a_hung_evaluation_is_bounded_and_logged_as_failed(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup

    async def eval_fn(model: art.TrainableModel, step: int) -> None:
        await asyncio.Event().wait()

    config = PipelineConfig(
        rollout_workers=2, groups_per_step=2, max_steps=2, eval_every_n_steps=1, eval_timeout_s=0.2
    )
    pipeline = Pipeline(model, Rollouts(backend), endless(), pipeline=config, eval_fn=eval_fn)
    assert len(await asyncio.wait_for(pipeline.run(), BOUND_S)) == 2
    assert pipeline.eval_errors == 2


async def test_a_cancellation_leaking_out_of_an_evaluation_is_logged_not_fatal(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    evaluated: list[int] = []

    async def eval_fn(model: art.TrainableModel, step: int) -> None:
        if step == 2:
            raise asyncio.CancelledError
        evaluated.append(step)

    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps=6, eval_every_n_steps=2)
    pipeline = Pipeline(model, Rollouts(backend), endless(), pipeline=config, eval_fn=eval_fn)
    assert len(await asyncio.wait_for(pipeline.run(), BOUND_S)) == 6
    assert evaluated == [4, 6] and pipeline.eval_errors == 1


async def test_resume_skips_exactly_what_was_consumed_even_through_none_scenarios(
    setup: tuple[TimedBackend, art.TrainableModel],
) -> None:
    backend, model = setup
    items = [0, None, 2, None, 4, 5, None, 7, 8, 9, None, 11]
    seen: list[Any] = []
    rollouts = Rollouts(backend)

    async def rollout(model: art.TrainableModel, scenario: Any) -> art.TrajectoryGroup:
        seen.append(scenario)
        return await rollouts(model, 0)

    config = PipelineConfig(rollout_workers=1, groups_per_step=2, max_steps_off_policy=0, max_steps=2)
    await asyncio.wait_for(train_async(model, rollout, list(items), pipeline=config), BOUND_S)
    seen.clear()  # it trained items[0:4] (None twice among them); a rollout in flight at the end is done again
    config = PipelineConfig(rollout_workers=1, groups_per_step=2, max_steps_off_policy=0, max_steps=1)
    await asyncio.wait_for(train_async(model, rollout, list(items), pipeline=config), BOUND_S)
    assert seen[:2] == items[4:6]


async def test_max_steps_zero_consumes_no_scenario(setup: tuple[TimedBackend, art.TrainableModel]) -> None:
    backend, model = setup
    seen: list[int] = []
    rollouts = Rollouts(backend)

    async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        seen.append(scenario)
        return await rollouts(model, scenario)

    config = PipelineConfig(rollout_workers=4, groups_per_step=2, max_steps=0)
    assert await asyncio.wait_for(train_async(model, rollout, range(10), pipeline=config), BOUND_S) == []
    assert seen == []


def captured_choice(version: int, served: str) -> Choice:
    """A Choice as our capture annotates it when the engine returned no token ids: no spans, but its model."""
    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
    )
    choice.model_extra.update({"policy_version": version, "policy_token_spans": [], "served_model": served})  # type: ignore[union-attr]
    return choice


@pytest.mark.parametrize("partner_version", [0, 999])
async def test_a_partner_models_choice_never_counts_as_the_trained_models(
    setup: tuple[TimedBackend, art.TrainableModel], partner_version: int
) -> None:
    backend, model = setup

    async def with_a_partner(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
        own = captured_choice(backend.step, f"pipe/agent@{backend.step}")
        partner = captured_choice(partner_version, f"pipe/opponent@{partner_version}")
        trajectories = []
        for reward in (0.0, 1.0):
            trajectory = art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "q"}, own], reward=reward
            )
            trajectory.additional_histories = [
                art.History(messages_and_choices=[{"role": "user", "content": "q"}, partner])
            ]
            trajectories.append(trajectory)
        await asyncio.sleep(0.01)
        return art.TrajectoryGroup(trajectories)

    backend.step = 5
    config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=1, max_steps=3)
    reports = await asyncio.wait_for(train_async(model, with_a_partner, endless(), pipeline=config), BOUND_S)
    assert len(reports) == 3 and reports[-1].metrics["discarded/cum/stale_groups"] == 0


async def test_making_room_never_waits_on_another_versions_load() -> None:
    engine: set[str] = set()
    load_s: dict[str, float] = {}

    async def load(version: Any) -> None:
        await asyncio.sleep(load_s.get(version.adapter, 0.0))
        engine.add(version.adapter)

    async def unload(version: Any) -> None:
        await asyncio.sleep(0.05)
        engine.discard(version.adapter)

    table = VersionTable(load, unload, lambda: 2, keep_old_s=60)
    for step in range(6):
        await table.publish("p/a", "a", step, Path(f"/x/{step}"))
    versions = table.models["p/a"].versions

    async def request(step: int) -> None:
        async with table.lock:
            table.pin(versions[step])
        try:
            await table.ensure_loaded(versions[step])
        finally:
            async with table.lock:
                table.unpin(versions[step])

    await request(3)
    load_s["p/a@4"] = 2.0
    slow = asyncio.create_task(request(4))  # loads for 2 s under a@4's lock
    await asyncio.sleep(0.1)
    await asyncio.wait_for(request(1), BOUND_S)  # must make room without touching a@4
    assert not slow.done(), "the request for @1 waited until @4's load ended"
    await asyncio.wait_for(slow, BOUND_S)
