"""The `art-adapters` command: demo | serve | import | doctor | plan | eval | report | tiny-model."""

from __future__ import annotations

import argparse
import sys

from .tiny import FAMILIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="art-adapters", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="train a LangGraph agent on the offline tiny model: SQLite tools, CPU, minutes"
    )
    demo.add_argument("--path", default=".art", help="backend folder (default .art)")
    demo.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo's own)")
    demo.add_argument("--out", default=None, help="where to write the reward curve PNG")
    demo.add_argument(
        "--family",
        choices=FAMILIES,
        default="byte",
        help="the tiny model's tokenizer: byte (default, learns fastest) or Qwen's real vocabulary and format",
    )
    demo.add_argument(
        "--warm-epochs", type=int, default=None, help="epochs of the SFT warm start (default 32)"
    )
    demo.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="roll out while the trainer steps (versioned weights, one step off-policy at most)",
    )

    commands.add_parser(
        "serve",
        help="expose a LocalBackend over HTTP for RemoteBackend clients (see `serve --help`)",
        add_help=False,
    )

    commands.add_parser(
        "import",
        help="production traces (Langfuse, OTLP files) to a JSONL of Trajectories (see `import --help`)",
        add_help=False,
    )

    commands.add_parser(
        "trainer-worker",
        help="join a sharded trainer from another host (see `trainer-worker --help`)",
        add_help=False,
    )

    commands.add_parser(
        "doctor",
        help="find where captured calls stop chaining (retokenization drift) and why (see `doctor --help`)",
        add_help=False,
    )

    commands.add_parser(
        "plan",
        help="the GPU memory plan for a base model, from its config.json alone (see `plan --help`)",
        add_help=False,
    )

    commands.add_parser(
        "eval",
        help="did training help? the same rollout over scenarios x attempts x steps, with intervals (see `eval --help`)",
        add_help=False,
    )

    report = commands.add_parser("report", help="write an HTML report (and PNG curves) of a model's run")
    report.add_argument("model_dir", help="e.g. .art/my-project/models/my-model")
    report.add_argument("--out", default=None, help="output HTML file (default: MODEL_DIR/report.html)")

    tiny = commands.add_parser("tiny-model", help="build an offline tiny Qwen model and its tokenizer")
    tiny.add_argument(
        "out_dir",
        nargs="?",
        default=None,
        help="where to build it (default: the shared cache, built once; the path is printed either way)",
    )
    tiny.add_argument(
        "--family",
        choices=FAMILIES,
        default="byte",
        help="byte: our 768-token tokenizer (default); qwen2.5 / qwen3: Qwen's real vocabulary and chat format",
    )

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .backend.launch import serve_command

        serve_command(argv[1:])
        return 0
    if argv[:1] == ["import"]:
        from .tracing.import_cli import import_command

        return import_command(argv[1:])
    if argv[:1] == ["trainer-worker"]:
        from .training.launcher import trainer_worker_command

        return trainer_worker_command(argv[1:])
    if argv[:1] == ["doctor"]:
        from .doctor import doctor_command

        return doctor_command(argv[1:])
    if argv[:1] == ["plan"]:
        from .plan_cli import plan_command

        return plan_command(argv[1:])
    if argv[:1] == ["eval"]:
        from .evaluation.cli import eval_command

        return eval_command(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo.run import run_demo_command

        run_demo_command(
            path=args.path,
            steps=args.steps,
            out=args.out,
            family=args.family,
            warm_epochs=args.warm_epochs,
            async_mode=args.async_mode,
        )
    elif args.command == "report":
        from .report import report_command

        report_command(args.model_dir, args.out)
    elif args.command == "tiny-model":
        from .tiny import tiny_model_command

        tiny_model_command(args.out_dir, args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
