"""`resume=`: an evaluation SIGKILLed midway loses no finished attempt, and the rerun does only what is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.capture.overrides import call_seed
from art_adapters.evaluation.resume import ResumeError
from art_adapters.testing import ScriptedServer
from eval_fakes import NAME, PROJECT, QUESTIONS, StepServingBackend, grader, rollout

ROOT = Path(__file__).resolve().parents[1]
TOTAL = 2 * 3 * len(QUESTIONS)  # targets x attempts x scenarios


def finished_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[1:-1]  # the header; a torn last line
    return [json.loads(line) for line in lines if line.strip()]


def kill_midway(base_url: str, resume: Path, after: int) -> int:
    """Run the evaluation in a subprocess and SIGKILL it once `after` attempts are in the file; its return code."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    script = str(ROOT / "tests" / "eval_resume_worker.py")
    worker = subprocess.Popen([sys.executable, script, base_url, str(resume)], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(finished_lines(resume)) < after:
            assert worker.poll() is None, "the worker ended before it was killed"
            assert time.monotonic() < deadline, "the worker finished too few attempts in 120 s"
            time.sleep(0.05)
        worker.send_signal(signal.SIGKILL)
        return worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)


async def test_resume_after_sigkill_redoes_nothing(tmp_path: Path) -> None:
    resume = tmp_path / "attempts.jsonl"
    with ScriptedServer(grader(3, delay_s=0.2)) as server:
        assert kill_midway(server.base_url, resume, after=12) == -signal.SIGKILL
    done = finished_lines(resume)
    assert 12 <= len(done) < TOTAL
    done_keys = {(a["target"], a["scenario_id"], a["attempt"]) for a in done}
    assert len(done_keys) == len(done)

    with ScriptedServer(grader(3)) as again:  # a new engine (another port): the same served names
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
        await model.register(StepServingBackend(again.base_url, (0, 3)))  # type: ignore[arg-type]
        result = await art.evaluate(model, rollout, QUESTIONS, attempts=3, resume=resume, progress=False)
        second = list(again.requests)

    assert len(second) == TOTAL - len(done)  # only what was left
    assert not any(_belongs_to(request, done) for request in second)  # no finished attempt is redone
    assert len(result.attempts) == TOTAL
    by_key = {(a.target, a.scenario_id, a.attempt): a for a in result.attempts}
    assert set(by_key) >= done_keys
    for attempt in done:  # the finished attempts are in the result as they were
        assert (
            by_key[(attempt["target"], attempt["scenario_id"], attempt["attempt"])].reward
            == attempt["reward"]
        )
    assert len(finished_lines(resume)) == TOTAL
    assert sorted(result.comparisons[0].changes.improved) == ["q1", "q4", "q7"]


def _belongs_to(request: dict, done: list[dict]) -> bool:
    """Whether a request is one of a finished attempt's (same step, scenario and seed)."""
    for attempt in done:
        question = next(q for q in QUESTIONS if q["id"] == attempt["scenario_id"])
        step = attempt["target"].split()[-1]
        if (
            request["model"] == f"{PROJECT}/{NAME}@{step}"
            and request["messages"][-1]["content"] == question["question"]
            and request["seed"] == call_seed(0, attempt["scenario_id"], attempt["attempt"], 0)
        ):
            return True
    return False


async def test_a_resume_file_of_another_evaluation_is_refused(tmp_path: Path) -> None:
    resume = tmp_path / "attempts.jsonl"
    with ScriptedServer(grader(3)) as server:
        model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
        await model.register(StepServingBackend(server.base_url, (0, 3)))  # type: ignore[arg-type]
        await art.evaluate(model, rollout, QUESTIONS[:2], attempts=1, resume=resume, progress=False)
        sent = len(server.requests)
        again = await art.evaluate(model, rollout, QUESTIONS[:2], attempts=1, resume=resume, progress=False)
        assert len(server.requests) == sent  # all done: nothing re-sent
        assert len(again.attempts) == 4
        with pytest.raises(ResumeError, match=r"different evaluation \(it differs in \['attempts'\]\)"):
            await art.evaluate(model, rollout, QUESTIONS[:2], attempts=2, resume=resume, progress=False)
        with resume.open("a") as handle:  # a write cut short by a crash
            handle.write('{"target": "step 0", "scen')
        await art.evaluate(model, rollout, QUESTIONS[:2], attempts=1, resume=resume, progress=False)
        assert len(finished_lines(resume)) == 4
