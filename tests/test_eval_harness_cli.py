"""`art-adapters eval`: the rollout by MODULE:FUNCTION, scenarios from a file, the table printed and the JSON
written; bad input refused (exit 2, the problem named) before any engine starts. The backend here serves a
scripted server's names as the model's steps (LocalBackend's vLLM start is covered by the vLLM tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import art_adapters.backend.local as local
from art_adapters.cli import main
from art_adapters.evaluation import EvalResult
from art_adapters.testing import ScriptedServer
from eval_fakes import NAME, PROJECT, QUESTIONS, StepServingBackend, grader
from test_eval_publish import langfuse_server  # noqa: F401 (a fixture)


def project_dir(root: Path, steps: tuple[int, ...]) -> Path:
    for step in steps:
        (root / PROJECT / "models" / NAME / "checkpoints" / f"{step:04d}").mkdir(parents=True)
    return root


def scenario_file(tmp_path: Path, items: list[dict]) -> Path:
    path = tmp_path / "scenarios.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in items))
    return path


def args(root: Path, scenarios: Path, *more: str) -> list[str]:
    return [
        "eval", "eval_fakes:rollout", "--scenarios", str(scenarios), "--model", NAME, "--project", PROJECT,
        "--base-model", "tiny", "--path", str(root), *more,
    ]  # fmt: skip


def test_eval_command_prints_the_table_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = project_dir(tmp_path / "art", (0, 3))
    with ScriptedServer(grader(3)) as server:
        backends: list[StepServingBackend] = []

        class Backend(StepServingBackend):
            def __init__(self, path: str) -> None:
                super().__init__(server.base_url, (0, 3))
                backends.append(self)

            async def close(self) -> None:
                self.closed = True

        monkeypatch.setattr(local, "LocalBackend", Backend)
        out = tmp_path / "result.json"
        code = main(args(root, scenario_file(tmp_path, QUESTIONS), "--attempts", "2", "--temperature", "0",
                         "--output", str(out), "--resume"))  # fmt: skip
        temperatures = {r["temperature"] for r in server.requests}
    assert code == 0
    printed = capsys.readouterr().out
    assert "step 0" in printed and "step 3" in printed
    result = EvalResult.from_dict(json.loads(out.read_text()))
    assert sorted(result.comparisons[0].changes.improved) == ["q1", "q4", "q7"]
    assert temperatures == {0}
    assert backends[0].closed
    attempts_file = root / PROJECT / "models" / NAME / "evaluations" / "val-attempts.jsonl"
    assert len(attempts_file.read_text().splitlines()) == 1 + 2 * 2 * len(QUESTIONS)


@pytest.mark.parametrize(
    ("steps", "scenarios", "extra", "message"),
    [
        ((0,), QUESTIONS, ["--steps", "0,5"], r"no checkpoint of step\(s\) \[5\]"),
        ((0, 3), [], [], "holds no scenarios"),
        ((0, 3), [{"question": "no id"}], [], "scenario 0 has no id"),
        ((0, 3), QUESTIONS, ["--attempts", "0"], "attempts must be an int >= 1"),
        ((0, 3), QUESTIONS, ["--steps", "0,best"], "unknown step 'best'"),
        ((0, 3), QUESTIONS, ["--top-p", "0"], "top_p must be in"),
        ((0, 3), QUESTIONS, ["--langfuse"], "--langfuse needs LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY"),
    ],
)
def test_eval_command_refuses_bad_input_before_starting(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    steps: tuple[int, ...],
    scenarios: list[dict],
    extra: list[str],
    message: str,
) -> None:
    def no_backend(*a: object, **k: object) -> None:
        raise AssertionError("the backend started before the input was checked")

    monkeypatch.setattr(local, "LocalBackend", no_backend)
    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("LANGFUSE_SECRET_KEY", raising=False)
    root = project_dir(tmp_path / "art", steps)
    assert main(args(root, scenario_file(tmp_path, scenarios), *extra)) == 2
    assert re.search(message, capsys.readouterr().err)


def test_eval_command_names_a_bad_rollout(tmp_path: Path) -> None:
    root = project_dir(tmp_path / "art", (0,))
    argv = args(root, scenario_file(tmp_path, QUESTIONS))
    argv[1] = "eval_fakes:nope"
    with pytest.raises(SystemExit, match="has no function 'nope'"):
        main(argv)


def test_eval_command_writes_the_page_and_logs_wandb_and_langfuse(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    langfuse_server: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    pytest.importorskip("wandb")
    from art_adapters import checkpoints
    from test_eval_publish import history_rows

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.teardown()  # W&B keeps its settings process-wide from its first run: let it read this test's WANDB_DIR
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", langfuse_server.public_key)
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", langfuse_server.secret_key)
    monkeypatch.setenv("LANGFUSE_BASE_URL", langfuse_server.base_url)
    root = project_dir(tmp_path / "art", (0, 3))
    with ScriptedServer(grader(3)) as server:

        class Backend(StepServingBackend):  # with LocalBackend's model folder
            def __init__(self, path: str) -> None:
                super().__init__(server.base_url, (0, 3))
                self.path = Path(path)

            def model_dir(self, model: Any) -> Path:
                return checkpoints.model_dir(model.project, model.name, self.path)

            async def close(self) -> None: ...

        monkeypatch.setattr(local, "LocalBackend", Backend)
        scenarios = scenario_file(tmp_path, QUESTIONS)
        code = main(args(root, scenarios, "--attempts", "1", "--wandb-project", "art-eval-cli", "--langfuse"))
        printed = capsys.readouterr().out
        page = root / PROJECT / "models" / NAME / "evaluation.html"
        assert code == 0 and f"report page: {page}" in printed
        assert "step 3 vs step 0" in page.read_text()
        (row,) = history_rows(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")))
        assert row["eval/step_3_vs_step_0/improved"] == 3
        from langfuse import Langfuse

        client = Langfuse(
            public_key=langfuse_server.public_key,
            secret_key=langfuse_server.secret_key,
            base_url=langfuse_server.base_url,
        )
        items = client.get_dataset(f"{PROJECT}/{NAME}/val").items
        assert sorted(i.input["id"] for i in items) == sorted(q["id"] for q in QUESTIONS)
        client.shutdown()

        page.unlink()
        assert main(args(root, scenarios, "--attempts", "1", "--no-report")) == 0
        assert "report page" not in capsys.readouterr().out and not page.exists()
