"""`art-adapters eval MODULE:ROLLOUT --scenarios FILE --model NAME ...`: art.evaluate from the shell, on the model's
LocalBackend folder (or a served backend with --backend-url); prints the table, writes the JSON result and the report
page, and logs to W&B (--wandb-project) and Langfuse (--langfuse)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .results import EvalResult


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="art-adapters eval",
        description="Evaluate a trained agent: the same rollout over scenarios x attempts x steps, with intervals.",
    )
    p.add_argument("rollout", help="the rollout: MODULE:FUNCTION or path/to/file.py:FUNCTION")
    p.add_argument("--scenarios", required=True, help=".jsonl or .json file of scenarios, each with an 'id'")
    p.add_argument("--model", required=True, help="the trained model's name")
    p.add_argument("--project", default="default", help="its project (default: default)")
    p.add_argument("--base-model", default=None, help="base model (default: the model folder's model.json)")
    p.add_argument("--path", default=".art", help="the LocalBackend folder (default .art)")
    p.add_argument(
        "--backend-url",
        default=None,
        help="a backend served by `art-adapters serve` instead (its key: env ART_ADAPTERS_API_KEY)",
    )
    p.add_argument(
        "--steps", default="0,latest", help="comma-separated steps: numbers and 'latest' (default 0,latest)"
    )
    p.add_argument("--attempts", type=int, default=4, help="attempts per scenario and step (default 4)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--seed", type=int, default=None, help="base of the per-(scenario, attempt) seeds (default 0)"
    )
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="MODEL,BASE_URL[,API_KEY_ENV]",
        help="another OpenAI-compatible model to evaluate (its key is read from API_KEY_ENV; repeatable)",
    )
    p.add_argument("--train-ids", default=None, help="file of the training scenarios (.jsonl/.json with ids)")
    p.add_argument("--success-threshold", type=float, default=None)
    p.add_argument("--max-error-fraction", type=float, default=0.1)
    p.add_argument("--max-concurrent", type=int, default=32)
    p.add_argument(
        "--attempt-timeout", type=float, default=600.0, help="seconds before an attempt counts as an error"
    )
    p.add_argument("--split", default="val")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="keep finished attempts in FILE (default: the model folder's evaluations/{split}-attempts.jsonl) "
        "and skip those already there",
    )
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.add_argument(
        "--no-report",
        action="store_true",
        help="write no report page (default: evaluation.html in the model folder, or beside --output)",
    )
    p.add_argument(
        "--wandb-project",
        default=None,
        metavar="NAME",
        help="log the metrics to a W&B run in this project (its key: env WANDB_API_KEY or `wandb login`)",
    )
    p.add_argument(
        "--langfuse",
        action="store_true",
        help="log a Langfuse dataset run per target (keys: env LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY; "
        "LANGFUSE_BASE_URL for your own server)",
    )
    return p


def load_rollout(spec: str) -> Any:
    """The function named by MODULE:FUNCTION or FILE.py:FUNCTION (the current folder is importable)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise SystemExit(f"art-adapters eval: rollout {spec!r} must be MODULE:FUNCTION or FILE.py:FUNCTION")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise SystemExit(f"art-adapters eval: no file {target!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise SystemExit(f"art-adapters eval: {target} has no function {name!r}")
    return function


def _references(values: list[str]) -> list[Any]:
    from .targets import Reference

    out = []
    for value in values:
        parts = [p.strip() for p in value.split(",")]
        if len(parts) not in (2, 3) or not all(parts):
            raise SystemExit(f"art-adapters eval: --reference {value!r} must be MODEL,BASE_URL[,API_KEY_ENV]")
        out.append(
            Reference(model=parts[0], base_url=parts[1], api_key_env=parts[2] if len(parts) == 3 else None)
        )
    return out


def _sampling(args: argparse.Namespace) -> dict[str, Any] | None:
    """The sampling settings given on the command line (None: none, the evaluation's defaults)."""
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def _base_model(args: argparse.Namespace) -> str:
    if args.base_model:
        return args.base_model
    saved = Path(args.path) / args.project / "models" / args.model / "model.json"
    if saved.is_file():
        base = json.loads(saved.read_text()).get("base_model")
        if base:
            return str(base)
    raise SystemExit(f"art-adapters eval: --base-model is needed ({saved} does not exist)")


async def run(args: argparse.Namespace) -> EvalResult:
    result, _ = await run_and_publish(args)
    return result


async def run_and_publish(args: argparse.Namespace) -> tuple[EvalResult, Path | None]:
    """The evaluation, and the report page it wrote (None: none)."""
    from ..model import TrainableModel
    from .harness import evaluate
    from .publish import report_page_path
    from .scenarios import load_scenarios, with_ids

    rollout = load_rollout(args.rollout)
    scenarios = load_scenarios(args.scenarios)  # bad files fail here, before any engine starts
    train_ids = [sid for sid, _ in with_ids(load_scenarios(args.train_ids))] if args.train_ids else None
    model = TrainableModel(name=args.model, project=args.project, base_model=_base_model(args))
    resume = args.resume
    if resume == "":
        resume = (
            Path(args.path)
            / args.project
            / "models"
            / args.model
            / "evaluations"
            / f"{args.split}-attempts.jsonl"
        )
    _check_before_start(args, scenarios, model)
    options: dict[str, Any] = {
        "attempts": args.attempts,
        "steps": [s.strip() for s in args.steps.split(",") if s.strip()],
        "split": args.split,
        "sampling": _sampling(args),
        "references": _references(args.reference),
        "train_ids": train_ids,
        "success_threshold": args.success_threshold,
        "max_error_fraction": args.max_error_fraction,
        "max_concurrent": args.max_concurrent,
        "attempt_timeout_s": args.attempt_timeout,
        "resume": resume,
        "output": args.output,
        "report": not args.no_report,
    }
    if args.backend_url:
        from ..backend.remote import RemoteBackend

        backend: Any = RemoteBackend(base_url=args.backend_url)
    else:
        from ..backend.local import LocalBackend

        backend = LocalBackend(args.path)
    started = time.time()
    wandb, langfuse = _sinks(args)
    try:
        await model.register(backend)
        result = await evaluate(model, rollout, scenarios, wandb=wandb, langfuse=langfuse, **options)
        page = None if args.no_report else report_page_path(model, args.output)
        if page is not None and not (page.is_file() and page.stat().st_mtime >= started - 1):
            page = None  # not written (it warned why)
        return result, page
    finally:
        await backend.close()
        if wandb is not None:
            wandb.finish()
        if langfuse is not None:
            langfuse.close()


def _sinks(args: argparse.Namespace) -> tuple[Any, Any]:
    """The W&B logger and the Langfuse exporter the flags ask for (None: not asked)."""
    wandb = langfuse = None
    if args.wandb_project:
        from ..tracing.wandb import WandbLogger

        wandb = WandbLogger(args.wandb_project, name=f"{args.model} eval ({args.split})", job_type="eval")
    if args.langfuse:
        from ..tracing.langfuse import LangfuseExporter

        langfuse = LangfuseExporter(project=args.project, tags=["art-adapters-eval"])
    return wandb, langfuse


def _check_before_start(args: argparse.Namespace, scenarios: list[Any], model: Any) -> None:
    """What can be refused without the engine, refused before it starts (minutes, on a GPU)."""
    from ..untrusted import check_name
    from .harness import Sampling, check_counts, check_limits
    from .scenarios import with_ids
    from .targets import check_steps, reference_target

    with_ids(scenarios)
    check_name("split", args.split)
    check_limits(args.attempt_timeout, args.success_threshold)
    for reference in _references(args.reference):
        reference_target(reference)  # its URL, and its key in the environment
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package (pip install wandb)")
    if args.langfuse:
        missing = [k for k in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY") if not os.environ.get(k)]
        if missing or importlib.util.find_spec("langfuse") is None:
            raise ValueError(
                f"--langfuse needs {' and '.join(missing)} in the environment (LANGFUSE_BASE_URL for your own "
                "server)"
                if missing
                else "--langfuse needs the langfuse package (pip install langfuse)"
            )
    check_counts(args.attempts, None, args.max_error_fraction, args.max_concurrent)
    Sampling.of(_sampling(args))
    steps = check_steps([s.strip() for s in args.steps.split(",") if s.strip()])
    if not args.backend_url:
        from ..backend.serving import servable_steps

        have = servable_steps(Path(args.path) / args.project / "models" / args.model)
        missing = [s for s in steps if isinstance(s, int) and s not in have]
        if missing or not have:
            raise ValueError(
                f"model {args.model!r} (project {args.project!r}) in {args.path} has no checkpoint of step(s) "
                f"{missing or steps} (its checkpoints: {have})"
            )


def format_result(result: EvalResult) -> str:
    """The printed table."""
    from .table import format_table

    return format_table(result)


def eval_command(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from .harness import EvaluationError
    from .resume import ResumeError
    from .scenarios import ScenarioError

    try:
        result, page = asyncio.run(run_and_publish(args))
    except (ScenarioError, ResumeError, EvaluationError, ValueError) as error:
        print(f"art-adapters eval: {error}", file=sys.stderr)
        return 2
    except TypeError as error:
        if not getattr(error, "unusable_rollout", False):  # a bug, with its traceback
            raise
        print(f"art-adapters eval: {error}", file=sys.stderr)  # the user's rollout returns the wrong type
        return 2
    print(format_result(result))
    if args.output:
        print(f"result: {args.output}")
    if page is not None:
        print(f"report page: {page}")
    return 0
