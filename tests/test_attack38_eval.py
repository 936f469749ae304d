"""Attacks on the evaluation harness (issue 38) from outside: rollouts that fail in odd ways (an unprintable
exception, a reward that is text or flagged missing, a sync rollout that hangs), settings of the wrong type, a key
where an environment variable's name belongs, references reached by the wrong model, and held-out honesty inside
training. Real HTTP against the scripted OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.evaluation import Reference
from art_adapters.testing import ScriptedServer
from art_adapters.trajectories import REWARD_MISSING
from eval_fakes import NAME, PROJECT, QUESTIONS, StepServingBackend, grader, rollout


async def registered(server: ScriptedServer, steps: tuple[int, ...] = (0, 3)) -> art.TrainableModel:
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    await model.register(StepServingBackend(server.base_url, steps))  # type: ignore[arg-type]
    return model


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


async def test_an_exception_that_cannot_be_printed_is_counted_not_fatal() -> None:
    async def raises_unprintable(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        if scenario["id"] == "q1":
            raise Unprintable()
        return await rollout(model, scenario)

    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        result = await art.evaluate(
            model, raises_unprintable, QUESTIONS[:4], max_error_fraction=1.0, progress=False
        )
    errored = [a for a in result.attempts if a.error]
    assert {a.scenario_id for a in errored} == {"q1"} and len(errored) == 2
    assert all(a.error.startswith("Unprintable") for a in errored)  # type: ignore[union-attr]
    assert result.target("step 0").scenarios == 3


@pytest.mark.parametrize("reward", ["0.5", "high", [1.0]])
async def test_a_reward_that_is_not_a_number_is_counted_as_an_error(reward: Any) -> None:
    async def odd_reward(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        trajectory = await rollout(model, scenario)
        trajectory.reward = reward  # pydantic does not check assignments
        return trajectory

    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        result = await art.evaluate(model, odd_reward, QUESTIONS[:2], max_error_fraction=1.0, progress=False)
    assert len(result.attempts) == 4
    assert all(a.reward is None and "not a finite number" in (a.error or "") for a in result.attempts)


async def test_a_trajectory_flagged_reward_missing_is_not_scored_zero() -> None:
    """An imported trajectory nothing rewarded carries a 0.0 placeholder: averaging it in as 0 would be a lie."""

    async def unrewarded(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        trajectory = await rollout(model, scenario)
        if scenario["id"] == "q0":
            trajectory.reward = 0.0
            trajectory.metadata[REWARD_MISSING] = True
        return trajectory

    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        result = await art.evaluate(model, unrewarded, QUESTIONS[:3], max_error_fraction=1.0, progress=False)
    missing = [a for a in result.attempts if a.scenario_id == "q0"]
    assert all(a.reward is None and "reward" in (a.error or "") for a in missing)
    assert result.target("step 0").errors == 1 and result.target("step 0").scenarios == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sampling": {"temperature": True}}, "temperature must be a number"),
        ({"sampling": {"top_p": True}}, "top_p must be in"),
        ({"max_error_fraction": True}, "max_error_fraction must be in"),
        ({"success_threshold": "0.5"}, "success_threshold must be a finite number"),
    ],
)
async def test_settings_of_the_wrong_type_are_refused_before_any_rollout(
    change: dict[str, Any], message: str
) -> None:
    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        with pytest.raises(ValueError, match=message):
            await art.evaluate(model, rollout, QUESTIONS[:2], progress=False, **change)
        assert server.requests == []


def test_a_key_given_where_an_environment_variables_name_belongs_is_refused_without_echoing_it() -> None:
    from art_adapters.evaluation.cli import _references
    from art_adapters.evaluation.targets import reference_target

    key = "sk-proj-Abc123secret"
    with pytest.raises(ValueError) as caught:
        reference_target(Reference("gpt", "https://api.example.com/v1", api_key_env=key))
    assert key not in str(caught.value) and "environment variable" in str(caught.value)
    with pytest.raises((ValueError, SystemExit)) as refused:
        _references([f"gpt,https://api.example.com/v1,{key}"])
    assert key not in str(refused.value)


async def test_train_async_knows_its_training_scenarios_are_not_held_out(tmp_path: Path) -> None:
    """The issue: when a run's training scenarios are known (the pipeline's source), evaluating any of them warns
    and marks the result not held out, without train_ids= given."""
    from art_adapters.pipeline import PipelineConfig, train_async
    from pipeline_fakes import Rollouts, TimedBackend

    class Scenario(int):
        @property
        def id(self) -> str:
            return f"q{int(self)}"

    with ScriptedServer(grader(trained_step=2)) as server:
        from test_eval_harness_pipeline import ServingTimedBackend

        backend: TimedBackend = ServingTimedBackend(tmp_path, server.base_url)
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
        await model.register(backend)
        evaluation = art.Evaluation(rollout, QUESTIONS[:4], attempts=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await train_async(
                model,
                Rollouts(backend),
                [Scenario(i) for i in range(2, 12)],  # trains on q2..q11
                pipeline=PipelineConfig(max_steps=1, groups_per_step=2, eval_every_n_steps=1),
                eval=evaluation,
            )
    result = evaluation.results[1]
    assert not result.held_out and result.not_held_out_ids == ["q2", "q3"]
    assert any("not held out" in str(w.message) for w in caught)


def _evaluate_in_a_process(code: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root / 'tests'}"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=180
    )


def test_a_sync_rollout_that_hangs_past_its_timeout_does_not_hang_the_process() -> None:
    """The attempt times out and is counted; the process then ends (a thread left sleeping must not keep
    `asyncio.run` or the interpreter waiting for it: `art-adapters eval` would never return)."""
    done = _evaluate_in_a_process(
        """
        import asyncio, time
        import art_adapters as art
        from art_adapters.evaluation import Reference

        def rollout(model, scenario):
            if scenario["id"] == "stuck":
                time.sleep(3600)
            return art.Trajectory(messages_and_choices=[], reward=1.0)

        async def main():
            reference = Reference("m", "http://127.0.0.1:9/v1", api_key_env=None, label="ref")
            result = await art.evaluate(
                art.Model(name="m", project="p"), rollout, [{"id": "stuck"}, {"id": "fine"}], steps=[],
                references=[reference], attempt_timeout_s=1, max_error_fraction=1.0, progress=False, report=False,
            )
            print("errors", result.targets[0].errors)

        asyncio.run(main())
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "errors 1" in done.stdout


async def test_sync_rollouts_run_max_concurrent_at_once() -> None:
    """max_concurrent is honoured for a sync rollout too, not capped by asyncio's default thread pool
    (min(32, cpus + 4) threads): every attempt must be running at once for the barrier to open."""
    width = min(32, (os.cpu_count() or 1) + 4) + 2
    barrier = threading.Barrier(width, timeout=60)

    def meets_the_others(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        barrier.wait()
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    reference = Reference("m", "http://127.0.0.1:9/v1", api_key_env=None, label="ref")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rollout sends no request: seeds not fixed
        result = await art.evaluate(
            art.Model(name="m", project="p"),
            meets_the_others,
            [{"id": f"s{i}"} for i in range(width)],
            steps=[],
            references=[reference],
            max_concurrent=width,
            max_error_fraction=1.0,
            progress=False,
            report=False,
        )
    assert result.targets[0].errors == 0


async def test_an_evaluation_in_training_without_sampling_does_not_refuse_a_rollout_with_its_own_client() -> (
    None
):
    """art.evaluate without sampling= warns that the seeds are not fixed for such a rollout; art.Evaluation without
    sampling= turned None into Sampling() and so failed every attempt as if settings had been asked for."""
    import openai

    async def own_client(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key="x", max_retries=0)
        async with client:
            await client.chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": scenario["question"]}]
            )
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        evaluation = art.Evaluation(own_client, QUESTIONS[:3], attempts=1, report=False)
        with pytest.warns(UserWarning, match="seeds are not fixed"):
            result = await evaluation.run(model, 3)
    assert [t.errors for t in result.targets] == [0, 0]


async def test_the_report_page_never_overwrites_the_json_result(tmp_path: Path) -> None:
    """Without a model folder the page goes beside `output` as its .html: an output named .html was replaced by
    the page, losing the result."""
    with ScriptedServer(grader(3)) as server:
        reference = Reference("reference-model", server.base_url, api_key_env=None, label="ref")
        output = tmp_path / "result.html"
        await art.evaluate(
            art.Model(name="m", project="p"),
            rollout,
            QUESTIONS[:2],
            steps=[],
            references=[reference],
            output=output,
            progress=False,
        )
    assert json.loads(output.read_text())["targets"][0]["target"] == "ref"


async def test_a_scenario_the_trained_step_always_errors_on_is_reported_in_the_comparison() -> None:
    """The gain pairs the scenarios both steps finished; a scenario every attempt of the trained step failed on
    (an answer the rollout cannot parse) drops out of it, which flatters the gain: it must be named there, not
    only counted in the step's errors."""

    async def trained_breaks_q1(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        if scenario["id"] == "q1" and model.get_inference_name().endswith("@3"):
            raise ValueError("the answer could not be parsed")
        return await rollout(model, scenario)

    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        result = await art.evaluate(
            model, trained_breaks_q1, QUESTIONS[:5], attempts=2, max_error_fraction=1.0, progress=False
        )
    (gain,) = result.comparisons
    assert gain.unpaired == ["q1"]
    assert "q1" not in gain.changes.improved + gain.changes.same + gain.changes.worse
    assert "not compared" in art.evaluation.table.format_table(result)
    again = art.evaluation.EvalResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.comparisons[0].unpaired == ["q1"]


async def test_a_decorated_agent_naming_the_model_itself_is_not_silently_evaluated_as_a_reference() -> None:
    """A decorated agent with its own client, naming the model as in training, is redirected to each step, but not
    to a reference endpoint: its requests went to the engine under the model's own name, which LocalBackend's
    gateway serves as the NEWEST step, so the 'reference' was the trained model compared with itself. Each such
    attempt must fail saying why, and the reference server is never reached by the engine's name."""
    import openai

    from art_adapters.adapters import wrap_rollout

    with ScriptedServer(grader(3)) as server, ScriptedServer(lambda request: "42") as elsewhere:
        model = await registered(server)
        agent_client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key="k", max_retries=0)

        @wrap_rollout(model)
        async def agent(_: art.Model, scenario: dict[str, Any]) -> float:
            answer = await agent_client.chat.completions.create(
                model=f"{PROJECT}/{NAME}", messages=[{"role": "user", "content": scenario["question"]}]
            )
            return 1.0 if answer.choices[0].message.content == scenario["answer"] else 0.0

        reference = Reference("bigger", elsewhere.base_url, api_key_env=None, label="ref")
        result = await art.evaluate(
            model, agent, QUESTIONS[:2], references=[reference], max_error_fraction=1.0, progress=False
        )
        await agent_client.close()
        engine_names = {r["model"] for r in server.requests}
    assert f"{PROJECT}/{NAME}" not in engine_names  # never answered by the newest step under the model's name
    assert [t.errors for t in result.targets] == [0, 0, 2]
    errors = {a.error for a in result.attempts if a.target == "ref"}
    assert len(errors) == 1 and "cannot be sent to reference 'ref'" in errors.pop()  # type: ignore[operator]


async def test_train_ids_given_as_one_string_are_refused() -> None:
    """`train_ids="train.jsonl"` (a path) or `"q0"` was iterated character by character: nothing matched, and the
    result was marked held out."""
    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        with pytest.raises(ValueError, match="train_ids must be ids"):
            await art.evaluate(model, rollout, QUESTIONS[:2], train_ids="q0", progress=False)
        assert server.requests == []
    with pytest.raises(ValueError, match="train_ids must be ids"):
        art.Evaluation(rollout, QUESTIONS[:2], train_ids="train.jsonl")


async def test_a_reference_gets_no_seed_on_the_responses_api_which_has_none() -> None:
    """OpenAI's Responses API has no `seed` (openai's ResponseCreateParams lacks it; the hosted API refuses unknown
    parameters), so adding one to every request of a Responses-API rollout made each attempt against a hosted
    reference fail. Our engine (vLLM) takes it, so the steps keep theirs."""

    async def responses_rollout(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        await model.openai_client().responses.create(model=model.get_inference_name(), input=scenario["id"])
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    with ScriptedServer(lambda request: "ok") as server, ScriptedServer(lambda request: "ok") as hosted:
        model = await registered(server)
        reference = Reference("gpt-hosted", hosted.base_url, api_key_env=None, label="ref")
        await art.evaluate(model, responses_rollout, [{"id": "a"}], references=[reference], progress=False)
        assert [r.get("seed") is not None for r in server.requests] == [True, True]
        assert [("seed" in r, r["model"]) for r in hosted.requests] == [(False, "gpt-hosted")]
