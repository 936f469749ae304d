"""Attacks on the evaluation harness (issue 38) from outside, its files and its command: a resume file after an
outage, edited by hand, cut in its header or used by two evaluations at once; a scenario file that is not UTF-8;
bad input to `art-adapters eval` refused before the engine starts. Real HTTP against the scripted server."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.evaluation import EvaluationError
from art_adapters.evaluation.resume import ResumeError
from art_adapters.testing import ScriptedServer
from eval_fakes import NAME, PROJECT, QUESTIONS, StepServingBackend, grader, rollout


async def registered(server: ScriptedServer, steps: tuple[int, ...] = (0, 3)) -> art.TrainableModel:
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    await model.register(StepServingBackend(server.base_url, steps))  # type: ignore[arg-type]
    return model


async def test_resume_after_an_outage_redoes_the_errored_attempts_only(tmp_path: Path) -> None:
    """An endpoint that was down fails the evaluation (too many errors); once it is back, --resume must run the
    failed attempts again rather than fail at once on the errors it kept, and must keep the finished ones."""
    down = {"q1", "q2"}

    async def outage(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
        if scenario["id"] in down:
            raise ConnectionError("endpoint down")
        return await rollout(model, scenario)

    resume = tmp_path / "attempts.jsonl"
    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        with pytest.raises(EvaluationError, match="endpoint down"):
            await art.evaluate(model, outage, QUESTIONS[:3], resume=resume, max_concurrent=1, progress=False)
        finished = [json.loads(line) for line in resume.read_text().splitlines()[1:]]
        finished_ok = {(a["target"], a["scenario_id"], a["attempt"]) for a in finished if a["error"] is None}
        assert finished_ok  # q0 finished before the budget ran out
        sent = len(server.requests)
        down.clear()  # the endpoint is back
        result = await art.evaluate(model, outage, QUESTIONS[:3], resume=resume, progress=False)
        redone = server.requests[sent:]
    assert [t.errors for t in result.targets] == [0, 0]
    assert len(redone) == 6 - len(finished_ok)  # the errored and the never-run attempts, nothing finished
    assert not any(r["messages"][-1]["content"] == QUESTIONS[0]["question"] for r in redone)
    assert len(result.attempts) == 6


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"reward": "NaN"}, "reward"),
        ({"reward": math.nan}, "reward"),
        ({"attempt": 7}, "not one of this evaluation's attempts"),
        ({"target": "step 99"}, "not one of this evaluation's attempts"),
        ({"scenario_id": 5}, "scenario_id"),
    ],
)
async def test_a_hand_edited_resume_file_is_refused_naming_the_line(
    edit: dict[str, Any], message: str, tmp_path: Path
) -> None:
    resume = tmp_path / "attempts.jsonl"
    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        await art.evaluate(model, rollout, QUESTIONS[:2], resume=resume, progress=False)
        lines = resume.read_text().splitlines()
        lines[2] = json.dumps({**json.loads(lines[2]), **edit})
        resume.write_text("\n".join(lines) + "\n")
        sent = len(server.requests)
        with pytest.raises(ResumeError, match=rf"attempts.jsonl:3: .*{message}"):
            await art.evaluate(model, rollout, QUESTIONS[:2], resume=resume, progress=False)
        assert len(server.requests) == sent  # refused before any rollout


async def test_two_evaluations_at_once_on_one_resume_file_the_second_is_refused(tmp_path: Path) -> None:
    """Both would run every attempt and append them twice (two processes starting together both write a header,
    which leaves a file no later resume can read): the second is refused before any rollout, naming the file."""
    import asyncio

    resume = tmp_path / "attempts.jsonl"
    with ScriptedServer(grader(3, delay_s=0.05)) as server:
        model = await registered(server)
        first, second = await asyncio.gather(
            art.evaluate(model, rollout, QUESTIONS[:4], resume=resume, progress=False),
            art.evaluate(model, rollout, QUESTIONS[:4], resume=resume, progress=False),
            return_exceptions=True,
        )
        assert isinstance(first, art.evaluation.EvalResult)
        assert isinstance(second, ResumeError) and "in use by another evaluation" in str(second)
        assert len(server.requests) == 8  # one evaluation's attempts, once
        again = await art.evaluate(model, rollout, QUESTIONS[:4], resume=resume, progress=False)  # released
    assert len(again.attempts) == 8 and len(server.requests) == 8
    assert len(resume.read_text().splitlines()) == 1 + 8


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reference", "gpt,http://127.0.0.1:9/v1,ART_ATTACK38_NO_SUCH_KEY"], "ART_ATTACK38_NO_SUCH_KEY"),
        (["--reference", "gpt,ftp://example.com"], "base_url must be an http"),
        (["--split", "../val"], "split name '../val' must match"),
        (["--attempt-timeout", "0"], "attempt_timeout_s must be a number > 0"),
        (["--success-threshold", "nan"], "success_threshold must be a finite number"),
    ],
)
def test_eval_command_refuses_these_before_the_engine_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    """The CLI promises bad input is refused before the engine starts (minutes on a GPU); these were refused only
    inside art.evaluate, after the model was registered and its engine started."""
    import re

    import art_adapters.backend.local as local
    from art_adapters.cli import main
    from test_eval_harness_cli import args, project_dir, scenario_file

    def no_backend(*a: object, **k: object) -> None:
        raise AssertionError("the backend started before the input was checked")

    monkeypatch.setattr(local, "LocalBackend", no_backend)
    monkeypatch.delenv("ART_ATTACK38_NO_SUCH_KEY", raising=False)
    root = project_dir(tmp_path / "art", (0, 3))
    assert main(args(root, scenario_file(tmp_path, QUESTIONS), *extra)) == 2
    assert re.search(message, capsys.readouterr().err)


async def test_a_resume_file_cut_in_its_header_starts_over_rather_than_failing(tmp_path: Path) -> None:
    """Killed while the header was written: no attempt was finished, so the file starts over (it was cut to nothing
    and refused with 'has no header line', so the first rerun always failed)."""
    resume = tmp_path / "attempts.jsonl"
    resume.write_text('{"format": 1, "evaluation": {"model": "ag')
    with ScriptedServer(grader(3)) as server:
        model = await registered(server)
        result = await art.evaluate(model, rollout, QUESTIONS[:2], resume=resume, progress=False)
    assert len(result.attempts) == 4
    assert len(resume.read_text().splitlines()) == 1 + 4


def test_a_scenario_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    from art_adapters.evaluation.scenarios import ScenarioError, load_scenarios

    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"id": "q0", "question": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ScenarioError, match=r"latin1.jsonl.*not UTF-8"):
        load_scenarios(latin)


def test_eval_command_names_a_rollout_of_the_wrong_type_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import art_adapters.backend.local as local
    from art_adapters.cli import main
    from test_eval_harness_cli import args, project_dir, scenario_file

    agent = tmp_path / "attack38_wrong_type_agent.py"
    agent.write_text(
        "from eval_fakes import rollout\n\n"
        "async def reward_only(model, scenario):\n"
        "    return (await rollout(model, scenario)).reward\n"
    )
    root = project_dir(tmp_path / "art", (0, 3))
    with ScriptedServer(grader(3)) as server:

        class Backend(StepServingBackend):
            def __init__(self, path: str) -> None:
                super().__init__(server.base_url, (0, 3))

            async def close(self) -> None:
                pass

        monkeypatch.setattr(local, "LocalBackend", Backend)
        argv = args(root, scenario_file(tmp_path, QUESTIONS[:2]))
        argv[1] = f"{agent}:reward_only"
        assert main(argv) == 2
    assert "returned float, not a Trajectory" in capsys.readouterr().err
