"""art.evaluate against a scripted OpenAI-compatible server (real HTTP, real wire format): the trained step is better on
a known subset of scenarios and the harness finds exactly that subset; sampling and seeds reach every request;
errors are counted, not dropped; held-out honesty; bad input refused before any rollout."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.capture.overrides import call_seed
from art_adapters.evaluation import EvalResult, EvaluationError, Reference
from art_adapters.testing import ScriptedServer
from eval_fakes import (
    BASE_RIGHT,
    COIN,
    IMPROVED,
    NAME,
    PROJECT,
    QUESTIONS,
    StepServingBackend,
    grader,
    rollout,
)

TRAINED = 3


async def registered(server: ScriptedServer, steps: tuple[int, ...] = (0, 1, TRAINED)) -> art.TrainableModel:
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    backend = StepServingBackend(server.base_url, steps)
    await model.register(backend)  # type: ignore[arg-type]
    return model


async def test_finds_exactly_the_improved_scenarios(tmp_path: Path) -> None:
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        result = await art.evaluate(
            model,
            rollout,
            QUESTIONS,
            attempts=4,
            sampling={"temperature": 0.5, "top_p": 0.9, "max_tokens": 16, "seed": 11},
            output=tmp_path / "result.json",
            progress=False,
        )
        requests = list(server.requests)
    assert [t.target for t in result.targets] == ["step 0", f"step {TRAINED}"]
    assert model.inference_model_name == f"{PROJECT}/{NAME}"  # the user's model is unchanged
    (diff,) = result.comparisons
    assert (diff.a, diff.b) == ("step 0", f"step {TRAINED}")
    assert sorted(diff.changes.improved) == sorted(IMPROVED)
    assert diff.changes.worse == []
    assert COIN in diff.changes.same  # the same seeds on both steps: the same draws
    assert diff.diff.mean == pytest.approx(len(IMPROVED) / len(QUESTIONS))
    assert 0 <= diff.diff.low < diff.diff.mean < diff.diff.high  # no scenario got worse: never below 0
    base, trained = result.target("step 0"), result.target(f"step {TRAINED}")
    assert base.scenarios == trained.scenarios == len(QUESTIONS)
    assert base.errors == trained.errors == 0
    # rewards are 0/1, so success is known; pass@k for every k <= attempts
    assert sorted(trained.pass_at_k) == [1, 2, 3, 4]
    coin_wins = sum(call_seed(11, COIN, a, 0) % 2 == 0 for a in range(4))
    expected_base = (len(BASE_RIGHT) + coin_wins / 4) / len(QUESTIONS)
    assert base.success_rate == pytest.approx(expected_base)
    assert base.reward.mean == pytest.approx(expected_base)
    assert base.pass_at_k[4] == pytest.approx((len(BASE_RIGHT) + (coin_wins > 0)) / len(QUESTIONS))
    # every request carried the evaluation's sampling, and a seed per (scenario, attempt) shared by the steps
    assert len(requests) == 2 * 4 * len(QUESTIONS)
    assert {(r["temperature"], r["top_p"], r["max_tokens"]) for r in requests} == {(0.5, 0.9, 16)}
    seeds: dict[str, set[int]] = {}
    for request in requests:
        seeds.setdefault(request["model"], set()).add(request["seed"])
    assert seeds[f"{PROJECT}/{NAME}@0"] == seeds[f"{PROJECT}/{NAME}@{TRAINED}"]
    assert len(seeds[f"{PROJECT}/{NAME}@0"]) == 4 * len(QUESTIONS)
    # the JSON file holds the same result, every attempt with its messages
    saved = EvalResult.from_dict(json.loads((tmp_path / "result.json").read_text()))
    assert saved.comparisons[0].changes.improved == diff.changes.improved
    assert len(saved.attempts) == 2 * 4 * len(QUESTIONS)
    assert saved.attempts[0].messages[-1]["role"] == "assistant"


async def test_any_step_and_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REF_KEY", "secret-ref-key")
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        reference = Reference(
            model="reference-model", base_url=server.base_url, api_key_env="REF_KEY", label="big"
        )
        result = await art.evaluate(
            model, rollout, QUESTIONS[:4], steps=[1, 0, "latest"], references=[reference], progress=False
        )
    assert [t.target for t in result.targets] == ["step 0", "step 1", f"step {TRAINED}", "big"]
    assert [(c.a, c.b) for c in result.comparisons] == [
        ("step 0", "step 1"),
        ("step 0", f"step {TRAINED}"),
        ("big", f"step {TRAINED}"),
    ]
    assert result.target("big").reward.mean == pytest.approx(1.0)  # the reference answers all right
    assert result.target("big").step is None


async def test_errors_are_counted_and_too_many_fail() -> None:
    async def flaky(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        if scenario["id"] == "q3":
            raise RuntimeError("the tool broke")
        trajectory = await rollout(model, scenario)
        if scenario["id"] == "q6":
            trajectory.reward = math.nan
        return trajectory

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        result = await art.evaluate(
            model, flaky, QUESTIONS, attempts=2, max_error_fraction=0.25, progress=False
        )
        errored = [a for a in result.attempts if a.error]
        assert len(errored) == 2 * 2 * 2
        assert {a.scenario_id for a in errored} == {"q3", "q6"}
        assert any("the tool broke" in a.error for a in errored if a.scenario_id == "q3")
        assert all("NaN" in a.error or "nan" in a.error for a in errored if a.scenario_id == "q6")
        assert result.target("step 0").errors == 4
        assert result.target("step 0").scenarios == len(QUESTIONS) - 2
        with pytest.raises(EvaluationError, match="the tool broke") as caught:
            await art.evaluate(model, flaky, QUESTIONS, attempts=2, max_error_fraction=0.1, progress=False)
        assert isinstance(caught.value.__cause__, RuntimeError)


async def test_a_rollout_returning_the_wrong_type_is_a_clear_error() -> None:
    async def returns_reward(model: art.Model, scenario: dict[str, Any]) -> float:
        await rollout(model, scenario)
        return 1.0

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        with pytest.raises(TypeError, match="returned float, not a Trajectory"):
            await art.evaluate(model, returns_reward, QUESTIONS, progress=False)  # type: ignore[arg-type]


async def test_sampling_a_rollout_cannot_carry_is_refused() -> None:
    import openai

    async def own_client(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key="x", max_retries=0)
        async with client:
            await client.chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": scenario["question"]}]
            )
        return art.Trajectory(messages_and_choices=[], reward=0.0)

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        with pytest.raises(EvaluationError, match="no request through art-adapters' client"):
            await art.evaluate(model, own_client, QUESTIONS, sampling={"temperature": 0}, progress=False)


async def test_train_ids_mark_the_result_not_held_out() -> None:
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        with pytest.warns(UserWarning, match="2 of 3 evaluation scenarios were used in training") as caught:
            result = await art.evaluate(
                model, rollout, QUESTIONS[:3], train_ids=["q0", "q2", "q99"], progress=False
            )
        assert len([w for w in caught if "used in training" in str(w.message)]) == 1
        assert not result.held_out and result.not_held_out_ids == ["q0", "q2"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clean = await art.evaluate(model, rollout, QUESTIONS[3:5], train_ids=["q0"], progress=False)
        assert clean.held_out and clean.not_held_out_ids == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": [2]}, r"step 2 of model 'agent' has no checkpoint"),
        ({"steps": ["newest"]}, "unknown step 'newest'"),
        ({"steps": [-1]}, "unknown step -1"),
        ({"scenarios": []}, "no scenarios"),
        ({"scenarios": [{"id": "a"}, {"id": "a"}]}, "scenario id 'a' is used twice"),
        ({"scenarios": [{"question": "x"}]}, "scenario 0 has no id"),
        ({"attempts": 0}, "attempts must be an int >= 1"),
        ({"attempts": 2, "pass_k": [3]}, r"1 <= k <= attempts \(2\); got k=3"),
        ({"comparisons": [("step 0", "step 9")]}, "unknown target 'step 9'"),
        ({"sampling": {"temperature": -1}}, "temperature must be a number >= 0"),
        ({"sampling": {"temp": 0}}, r"unknown sampling settings \['temp'\]"),
        (
            {"references": [Reference("m", "http://127.0.0.1:9/v1", api_key_env="ART_EVAL_NO_SUCH_KEY")]},
            "ART_EVAL_NO_SUCH_KEY",
        ),
        ({"max_error_fraction": 2}, "max_error_fraction must be in"),
        ({"split": "../val"}, "split name '../val' must match"),
        ({"attempt_timeout_s": 0}, "attempt_timeout_s must be a number > 0"),
    ],
)
async def test_bad_input_is_refused_before_any_rollout(
    change: dict[str, Any], message: str, tmp_path: Path
) -> None:
    calls: list[Any] = []

    async def counting(model: art.Model, scenario: Any) -> art.Trajectory:
        calls.append(scenario)
        return art.Trajectory(messages_and_choices=[], reward=0.0)

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server, steps=(0, 1))
        options: dict[str, Any] = {"scenarios": QUESTIONS[:2], "progress": False, **change}
        scenarios = options.pop("scenarios")
        with pytest.raises(ValueError, match=message):
            await art.evaluate(model, counting, scenarios, **options)
    assert calls == []


def test_scenario_files(tmp_path: Path) -> None:
    from art_adapters.evaluation.scenarios import ScenarioError, load_scenarios

    lines = tmp_path / "s.jsonl"
    lines.write_text("\n".join(json.dumps(q) for q in QUESTIONS[:3]) + "\n\n")
    assert [s["id"] for s in load_scenarios(lines)] == ["q0", "q1", "q2"]
    whole = tmp_path / "s.json"
    whole.write_text(json.dumps({"scenarios": QUESTIONS[:2]}))
    assert len(load_scenarios(whole)) == 2
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ScenarioError, match="holds no scenarios"):
        load_scenarios(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{oops\n')
    with pytest.raises(ScenarioError, match="bad.jsonl:2: not JSON"):
        load_scenarios(tmp_path / "bad.jsonl")
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenarios(tmp_path / "missing.jsonl")


async def test_a_decorated_rollout_with_its_own_client_runs_unchanged() -> None:
    """A `wrap_rollout` agent that builds its own client and names the model itself (as agents written for
    training do): its requests reach each target, with the evaluation's sampling."""
    import openai

    from art_adapters.adapters import wrap_rollout

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        agent_client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key="k", max_retries=0)

        @wrap_rollout(model)
        async def agent(_: art.Model, scenario: dict[str, Any]) -> float:
            answer = await agent_client.chat.completions.create(
                model=f"{PROJECT}/{NAME}",  # hard-coded: the model's name, as in training
                messages=[{"role": "user", "content": scenario["question"]}],
                temperature=1.0,
            )
            return 1.0 if answer.choices[0].message.content == scenario["answer"] else 0.0

        result = await art.evaluate(
            model, agent, QUESTIONS, attempts=2, sampling={"temperature": 0.25}, progress=False
        )
        await agent_client.close()
        requests = list(server.requests)
    assert sorted(result.comparisons[0].changes.improved) == sorted(IMPROVED)
    assert {r["model"] for r in requests} == {f"{PROJECT}/{NAME}@0", f"{PROJECT}/{NAME}@{TRAINED}"}
    assert {r["temperature"] for r in requests} == {0.25}
    assert all(a.messages for a in result.attempts)  # the captured conversation


async def test_a_hung_attempt_times_out_as_an_error_and_sync_rollouts_run() -> None:
    import asyncio

    import openai

    from art_adapters.adapters import wrap_rollout

    async def hangs_on_q2(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        if scenario["id"] == "q2":
            await asyncio.Event().wait()
        return await rollout(model, scenario)

    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(server)
        result = await art.evaluate(
            model, hangs_on_q2, QUESTIONS[:4], attempt_timeout_s=1.0, max_error_fraction=1.0, progress=False
        )
        hung = [a for a in result.attempts if a.scenario_id == "q2"]
        assert len(hung) == 2 and all(a.reward is None for a in hung)
        # (on a loaded machine another attempt may time out too: the same error, never a hang)
        assert {a.error for a in result.attempts if a.error} == {
            "TimeoutError: the attempt ran longer than 1 s"
        }

        client = openai.OpenAI(base_url=model.inference_base_url, api_key="k", max_retries=0)

        @wrap_rollout(model)
        def sync_agent(_: art.Model, scenario: dict[str, Any]) -> float:  # a sync agent: run in a thread
            answer = client.chat.completions.create(
                model=f"{PROJECT}/{NAME}", messages=[{"role": "user", "content": scenario["question"]}]
            )
            return 1.0 if answer.choices[0].message.content == scenario["answer"] else 0.0

        synced = await art.evaluate(model, sync_agent, QUESTIONS, sampling={"seed": 3}, progress=False)
        client.close()
    assert sorted(synced.comparisons[0].changes.improved) == sorted(IMPROVED)


async def test_serve_checkpoint_publishes_an_old_step_or_names_those_there(tmp_path: Path) -> None:
    import asyncio

    import torch
    from safetensors.torch import load_file, save_file

    from art_adapters.backend.serving import Registered, servable_steps, serve_checkpoint

    published: list[tuple[str, str, int, Path]] = []

    class Gateway:
        async def publish(self, key: str, name: str, step: int, path: Path) -> str:
            published.append((key, name, step, path))
            return f"{key}@{step}"

    assert servable_steps(tmp_path) == []
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    for step in (0, 4):
        folder = tmp_path / "checkpoints" / f"{step:04d}"
        folder.mkdir(parents=True)
        tensors = {f"{layer}.lora_A.weight": torch.randn(8, 16), f"{layer}.lora_B.weight": torch.randn(16, 8)}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text('{"r": 8}')
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    state = Registered(model, tmp_path, None, Gateway(), None, 4, asyncio.Lock())  # type: ignore[arg-type]
    assert await serve_checkpoint(state, 0) == f"{PROJECT}/{NAME}@0"
    assert published[-1] == (f"{PROJECT}/{NAME}", NAME, 0, tmp_path / "checkpoints" / "0000")
    with pytest.raises(ValueError, match=r"no checkpoint of step 2 \(its checkpoints: \[0, 4\]\)"):
        await serve_checkpoint(state, 2)

    # step 0's checkpoint deleted (delete_checkpoints keeps the latest and the best): the base model is still
    # served, as the newest adapter with a zero update
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "0000")
    assert servable_steps(tmp_path) == [0, 4]
    assert await serve_checkpoint(state, 0) == f"{PROJECT}/{NAME}@0"
    base = tmp_path / "base-adapter"
    assert published[-1] == (f"{PROJECT}/{NAME}", NAME, 0, base)
    zeroed = load_file(str(base / "adapter_model.safetensors"))
    newest = load_file(str(tmp_path / "checkpoints" / "0004" / "adapter_model.safetensors"))
    assert torch.equal(zeroed[f"{layer}.lora_A.weight"], newest[f"{layer}.lora_A.weight"])
    assert not zeroed[f"{layer}.lora_B.weight"].any() and newest[f"{layer}.lora_B.weight"].any()
    assert (base / "adapter_config.json").read_text() == '{"r": 8}'


def test_the_progress_bar_counts_attempts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import art_adapters.progress as progress

    monkeypatch.setattr(progress, "live_display", lambda: True)

    async def run() -> None:
        with ScriptedServer(grader(TRAINED)) as server:
            model = await registered(server)
            await art.evaluate(model, rollout, QUESTIONS[:3], attempts=2)

    asyncio.run(run())
    err = capsys.readouterr().err
    assert "evaluate" in err and "12/12" in err
