"""Results where users look, wired: art.evaluate and art.Evaluation (inside train_async) write the report page into
the model's folder and log W&B (the real SDK, offline) and Langfuse dataset runs (the real SDK against the local API
stand-in); a sink that is down warns once, naming itself, and the result and its JSON survive. The backend serves a
scripted server's names as the model's steps (eval_fakes) and has a model folder as LocalBackend does."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.evaluation import EvalResult
from art_adapters.pipeline import PipelineConfig, train_async
from art_adapters.testing import ScriptedServer
from eval_fakes import IMPROVED, NAME, PROJECT, QUESTIONS, StepServingBackend, grader, rollout
from pipeline_fakes import Rollouts
from test_eval_harness_pipeline import ServingTimedBackend

TRAINED = 3


class FolderBackend(StepServingBackend):
    """StepServingBackend with LocalBackend's model folder: `{path}/{project}/models/{name}`."""

    def __init__(self, base_url: str, steps: tuple[int, ...], path: Path) -> None:
        super().__init__(base_url, steps)
        self.path = path

    def model_dir(self, model: art.Model) -> Path:
        return checkpoints.model_dir(model.project, model.name, self.path)


class FolderTimedBackend(ServingTimedBackend):
    def model_dir(self, model: art.Model) -> Path:
        return checkpoints.model_dir(model.project, model.name, self.path)


@pytest.fixture
def langfuse_server() -> Any:
    pytest.importorskip("langfuse")
    from art_adapters.testing.langfuse_api import LangfuseAPIServer

    public, secret = f"pk-lf-{uuid.uuid4().hex[:12]}", f"sk-lf-{uuid.uuid4().hex[:12]}"
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        yield server


async def registered(backend: Any) -> art.TrainableModel:
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    await model.register(backend)
    return model


@dataclasses.dataclass
class Question:
    """A scenario that is not JSON: a dataclass with a frozenset inside."""

    id: str
    question: str
    answer: str
    tags: frozenset[str] = frozenset({"math", "easy"})


async def question_rollout(model: art.Model, scenario: Question) -> art.Trajectory:
    return await rollout(model, {"question": scenario.question, "answer": scenario.answer})


def history_rows(run_file: Path, count: int = 1) -> list[dict[str, Any]]:
    """An offline run's history rows, waiting (bounded) for `count`: wandb-core may still be writing the last block."""
    from test_wandb import read_history

    deadline = time.monotonic() + 15
    while len(rows := read_history(run_file)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return rows


def page_points(page: str) -> list[str]:
    """The reward chart's targets, in order."""
    chart = page[page.index('data-metric="reward"') : page.index('data-metric="pass@k"')]
    return [part.split('"')[0] for part in chart.split('class="point" data-target="')[1:]]


async def test_evaluate_writes_the_page_in_the_model_folder_and_logs_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="art-eval-publish", name="eval")
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(FolderBackend(server.base_url, (0, TRAINED), tmp_path / "art"))
        result = await art.evaluate(model, rollout, QUESTIONS, attempts=2, progress=False, wandb=run)
    run_dir = Path(run.dir).parent
    run.finish()
    page = tmp_path / "art" / PROJECT / "models" / NAME / "evaluation.html"
    text = page.read_text()
    assert page_points(text) == ["step 0", f"step {TRAINED}"]
    assert f"{PROJECT}/{NAME} — evaluation (val)" in text
    (row,) = await asyncio.to_thread(history_rows, next(run_dir.glob("*.wandb")))
    trained = result.target(f"step {TRAINED}")
    assert row[f"eval/step_{TRAINED}/reward"] == pytest.approx(trained.reward.mean)
    assert row[f"eval/step_{TRAINED}_vs_step_0/improved"] == len(IMPROVED)


async def test_evaluate_without_a_model_folder_writes_the_page_beside_output_or_nowhere(
    tmp_path: Path,
) -> None:
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(StepServingBackend(server.base_url, (0, TRAINED)))  # no model_dir
        await art.evaluate(
            model, rollout, QUESTIONS[:3], progress=False, output=tmp_path / "out" / "eval.json"
        )
        assert page_points((tmp_path / "out" / "eval.html").read_text()) == ["step 0", f"step {TRAINED}"]
        await art.evaluate(
            model,
            rollout,
            QUESTIONS[:3],
            progress=False,
            output=tmp_path / "quiet" / "eval.json",
            report=False,
        )
        assert sorted(p.name for p in (tmp_path / "quiet").iterdir()) == ["eval.json"]


async def test_evaluate_logs_a_langfuse_dataset_run_per_target_with_dataclass_scenarios(
    tmp_path: Path, langfuse_server: Any
) -> None:
    from art_adapters.tracing.langfuse import LangfuseExporter

    exporter = LangfuseExporter(
        langfuse_server.public_key, langfuse_server.secret_key, langfuse_server.base_url
    )
    questions = [Question(q["id"], q["question"], q["answer"]) for q in QUESTIONS[:4]]
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(FolderBackend(server.base_url, (0, TRAINED), tmp_path))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no sink warned
            await art.evaluate(
                model, question_rollout, questions, attempts=2, progress=False, langfuse=exporter
            )
    client = exporter.client
    dataset = client.get_dataset(f"{PROJECT}/{NAME}/val")
    inputs = {i.metadata["scenario_id"]: i.input for i in dataset.items}
    assert inputs["q1"] == {
        "id": "q1",
        "question": QUESTIONS[1]["question"],
        "answer": "7",
        "tags": ["easy", "math"],
    }
    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    experiments = client.api.experiments.list(from_start_time=since, dataset_id=dataset.id).data
    assert sorted((e.name, e.item_count) for e in experiments) == [
        (f"{NAME} step 0", 8),
        (f"{NAME} step {TRAINED}", 8),
    ]
    exporter.close()


class DownRun:
    """A wandb Run whose service is down."""

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise ConnectionError("wandb.ai unreachable")


class DownLangfuse:
    """A langfuse.Langfuse whose server is down."""

    def create_dataset(self, **_: Any) -> None:
        raise ConnectionError("langfuse unreachable")

    def run_experiment(self, **_: Any) -> None:
        raise AssertionError("not reached")


async def test_sinks_that_are_down_warn_once_each_and_lose_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "art" / PROJECT / "models" / NAME
    (folder / "evaluation.html").mkdir(parents=True)  # the page cannot be written: a folder is in its way
    output = tmp_path / "eval.json"
    with ScriptedServer(grader(TRAINED)) as server:
        model = await registered(FolderBackend(server.base_url, (0, TRAINED), tmp_path / "art"))
        with pytest.warns(RuntimeWarning) as caught:
            result = await art.evaluate(
                model,
                rollout,
                QUESTIONS,
                progress=False,
                output=output,
                wandb=DownRun(),
                langfuse=DownLangfuse(),
            )
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 3
        assert "the report page was not updated" in messages[0]
        assert "W&B was not updated (ConnectionError: wandb.ai unreachable)" in messages[1]
        assert "Langfuse was not updated (ConnectionError: langfuse unreachable)" in messages[2]
        assert sorted(result.comparisons[0].changes.improved) == sorted(IMPROVED)
        saved = EvalResult.from_dict(json.loads(output.read_text()))
        assert saved.comparisons[0].changes.improved == result.comparisons[0].changes.improved
        before = len(server.requests)
        with pytest.raises(TypeError, match="wandb= must be a WandbLogger or a wandb Run"):
            await art.evaluate(model, rollout, QUESTIONS, progress=False, wandb=object())
        with pytest.raises(TypeError, match="langfuse= must be a LangfuseExporter"):
            await art.evaluate(model, rollout, QUESTIONS, progress=False, langfuse="pk-lf-key")
        assert len(server.requests) == before  # refused before any rollout
    with pytest.raises(TypeError, match="wandb= must be"):
        art.Evaluation(rollout, QUESTIONS, wandb=object())


async def test_training_updates_the_page_and_logs_each_new_step_once(
    tmp_path: Path, langfuse_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from langfuse import Langfuse

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="art-eval-publish", name="train")
    run.log(
        {"train/loss": 1.0}, step=10
    )  # training has logged later steps by the time an evaluation finishes

    client = Langfuse(
        public_key=langfuse_server.public_key,
        secret_key=langfuse_server.secret_key,
        base_url=langfuse_server.base_url,
    )
    pages: list[list[str]] = []
    with ScriptedServer(grader(trained_step=2)) as server:
        backend = FolderTimedBackend(tmp_path, server.base_url)
        model = await registered(backend)
        page = backend.model_dir(model) / "evaluation.html"
        evaluation = art.Evaluation(
            rollout, QUESTIONS[:4], attempts=2, wandb=run, langfuse=client, output_dir=tmp_path / "json"
        )

        async def watched(model: art.TrainableModel, step: int, *rest: Any) -> None:
            await evaluation(model, step, *rest)
            pages.append(page_points(page.read_text()))

        await train_async(
            model,
            Rollouts(backend),
            range(100),
            pipeline=PipelineConfig(max_steps=2, groups_per_step=2, eval_every_n_steps=1, eval_at_start=True),
            eval=watched,  # type: ignore[arg-type]
        )
    assert pages == [
        ["step 0"],
        ["step 0", "step 1"],
        ["step 0", "step 1", "step 2"],
    ]  # the page follows training
    assert "step 2 vs step 0" in page.read_text() and (tmp_path / "json" / "step-0002.json").is_file()
    run_dir = Path(run.dir).parent
    run.finish()
    rows = await asyncio.to_thread(history_rows, next(run_dir.glob("*.wandb")), 4)
    evaluated = {
        row["eval/step"]: row for row in rows if "eval/step" in row
    }  # on their own axis: none dropped
    assert sorted(evaluated) == [0, 1, 2]
    assert evaluated[2]["eval/step_2_vs_step_0/improved"] == len(IMPROVED & {q["id"] for q in QUESTIONS[:4]})
    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    experiments = client.api.experiments.list(from_start_time=since).data
    # step 0 logged once although every later result carries it; each step a run of 4 scenarios x 2 attempts
    assert sorted((e.name, e.item_count) for e in experiments) == [
        (f"{NAME} step 0", 8),
        (f"{NAME} step 1", 8),
        (f"{NAME} step 2", 8),
    ]
    client.shutdown()


def test_scenarios_become_json_and_a_sink_down_warns_once_across_evaluations(tmp_path: Path) -> None:
    import pydantic

    from art_adapters.evaluation.publish import Publisher, plain_scenario
    from eval_fixtures import eval_result

    class Plain:
        def __init__(self) -> None:
            self.id, self.when, self._secret = "p1", dt.date(2026, 1, 2), "hidden"

    class Typed(pydantic.BaseModel):
        id: str
        path: Path

    assert plain_scenario(Plain()) == {"id": "p1", "when": "2026-01-02"}
    assert plain_scenario(Typed(id="t1", path=Path("/a/b"))) == {"id": "t1", "path": "/a/b"}
    assert plain_scenario({"q": Question("q0", "?", "0")}) == {
        "q": {"id": "q0", "question": "?", "answer": "0", "tags": ["easy", "math"]}
    }
    publisher = Publisher(tmp_path / "page.html", DownRun())
    with pytest.warns(RuntimeWarning, match="W&B was not updated") as caught:
        for _ in range(3):  # a training run's evaluations: the first failure warns, the rest do not
            assert publisher.publish(eval_result(), step=1) == tmp_path / "page.html"
    assert len([w for w in caught if "W&B" in str(w.message)]) == 1
