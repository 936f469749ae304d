"""`art-adapters demo`: RL on the offline tiny model for the unchanged LangGraph agent of `demo/agent.py`, whose
tools answer from a real SQLite database of orders. Reads top to bottom: warm start, then rollouts -> GRPO step ->
hot-swapped adapter, then where to look (the HTML report, Langfuse)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..gather import gather_trajectory_groups
from ..model import TrainableModel
from ..trajectories import Trajectory, TrajectoryGroup
from .orders import Question, questions, reward, warm_start_examples
from .steps import pipeline_steps, plot_curve, served_swap, warm_start, with_clock

RECURSION_LIMIT = 6  # agent -> tools -> agent is 3 graph steps; a model that keeps calling tools is stopped


def make_rollout(model: TrainableModel, db_path: Path) -> Any:
    """The training code a user writes around their agent: the decorator, the graph run as it is, a reward."""
    from langgraph.errors import GraphRecursionError

    from ..langgraph import wrap_rollout
    from .agent import build_agent

    assert model.inference_base_url is not None
    api_key = model.inference_api_key or "none"  # the local endpoint's key (never on a command line)

    @wrap_rollout(model)
    async def rollout(question: Question, seed: int | None = None) -> float:
        agent = build_agent(
            model.inference_base_url, model.get_inference_name(), db_path, api_key=api_key, seed=seed
        )
        try:
            state = await agent.ainvoke(
                {"messages": [("user", question.text)]}, {"recursion_limit": RECURSION_LIMIT}
            )
        except GraphRecursionError:
            return 0.0
        return reward(question, state["messages"])

    async def scored(question: Question, seed: int) -> Trajectory:
        trajectory: Trajectory = await rollout(question, seed)
        trajectory.metrics["success"] = float(trajectory.reward == 1.0)
        trajectory.metrics["called_tool"] = float(trajectory.reward > 0.0)
        trajectory.metadata["tool"] = question.tool
        return trajectory

    return scored


def question_groups(rollout: Any, asked: list[Question], size: int, seed: int) -> list[TrajectoryGroup]:
    """One group of `size` rollouts per question, each rollout on its own sampling seed."""
    return [
        TrajectoryGroup(rollout(q, seed + 2 * (k * size + i)) for i in range(size))
        for k, q in enumerate(asked)
    ]


async def evaluate_demo(
    model: TrainableModel,
    rollout: Any,
    asked: list[Question],
    attempts: int,
    seed: int,
    exporter: Any = None,
    output: Path | None = None,
) -> Any:
    """The harness (`art.evaluate`) on the demo's questions: the warm start (step 1) and the newest step, each
    question `attempts` times at temperature 1 on the same seeded draws; success = the database's answer."""
    from ..evaluation import Sampling, evaluate

    async def attempt(target: TrainableModel, scenario: dict[str, Any]) -> Trajectory:
        trajectory: Trajectory = await rollout(scenario["question"], None)  # the harness seeds each call
        return trajectory

    scenarios = [{"id": f"q{k + 1}", "question": q} for k, q in enumerate(asked)]
    return await evaluate(
        model,
        attempt,
        scenarios,
        attempts=attempts,
        steps=[1, "latest"],
        sampling=Sampling(temperature=1.0, seed=seed * 7919 + 1),
        success_threshold=1.0,
        langfuse=exporter,  # a dataset run per step in Langfuse, when it is on
        output=output,  # the result as JSON (`evaluation.html` beside it in the model's folder)
    )


def langfuse_exporter() -> Any:
    """A LangfuseExporter when LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are set; None otherwise."""
    if not (os.environ.get("LANGFUSE_PUBLIC_KEY") and os.environ.get("LANGFUSE_SECRET_KEY")):
        return None
    from ..tracing.langfuse import LangfuseExporter

    return LangfuseExporter(project="demo", tags=["art-adapters-demo"])


def where_to_look(report: Path, exporter: Any) -> list[str]:
    lines = [
        f"report: {report}  (open it in a browser: each rollout's tool calls, results and reward; the curves)"
    ]
    page = report.with_name("evaluation.html")
    if page.exists():
        lines.append(
            f"evaluation: {page}  (each question's attempts at both steps, the gain with its interval)"
        )
    if exporter is None:
        lines.append(
            "Langfuse: off (set LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_BASE_URL, "
            "`pip install 'art-adapters[langfuse]'`, to get every rollout as a trace)"
        )
    elif exporter.client is None:
        lines.append("Langfuse: not sent (see the warning above)")
    else:
        url = os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or "Langfuse"
        lines.append(f"Langfuse: {exporter.exported} traces in {url}, session {exporter.session_id}")
    return lines


# --- the run ----------------------------------------------------------------------------------------------------
def step_rate(k: int, steps: int, rate: float, decay_start: float | None) -> float:
    """The learning rate of step `k` (0-based) of `steps`: `rate` until the `decay_start` share of the run, then
    falling linearly to a tenth of it at the last step; None: `rate` throughout. At a constant 1.2e-3 a late step
    could overshoot (0.906 -> 0.125 success in two steps, grad norm 12.4) and leave the demo's end to chance."""
    if decay_start is None:
        return rate
    start = decay_start * steps
    if k < start:
        return rate
    return rate * (1 - 0.9 * min(1.0, (k - start) / max(steps - 1 - start, 1)))


async def run_demo(
    path: str | Path = ".art",
    *,
    steps: int = 20,
    group_size: int = 8,
    learning_rate: float = 1.2e-3,
    lora_rank: int = 16,
    warm_examples: int = 64,
    warm_epochs: int = 48,
    warm_learning_rate: float = 5e-3,
    eval_samples: int = 8,
    out: str | Path | None = None,
    seed: int = 0,
    family: str = "byte",
    async_mode: bool = False,
    decay_start: float | None = 0.5,
) -> dict[str, float]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from ..backend.local import LocalBackend
    from ..envs.sqlite import build_database
    from ..inference import InferenceConfig
    from ..report import write_report
    from ..tiny import tiny_model_path
    from .agent import SYSTEM, order_tools

    if decay_start is not None and not 0 <= decay_start <= 1:
        raise ValueError(f"decay_start must be a share of the run (0 to 1) or None, not {decay_start!r}")
    if async_mode and decay_start is not None:  # train_async steps on one TrainConfig
        raise ValueError("the async demo trains at one constant rate: pass decay_start=None with async_mode")
    started = time.perf_counter()
    seconds: dict[str, float] = {}  # where the time went, by phase

    def lap(phase: str, since: float) -> float:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - since
        return seconds[phase]

    root = Path(path)
    print(
        f"1/4 the offline tiny model, {family} tokenizer (built once, cached), and the orders database ...",
        flush=True,
    )
    since = time.perf_counter()
    model = TrainableModel(
        name="order-agent" if family == "byte" else f"order-agent-{family}",
        project="demo",
        base_model=str(tiny_model_path(family)),
        lora=LoRAConfig(rank=lora_rank, alpha=2 * lora_rank),
    )
    # a loaded machine starts vLLM slowly (over 5 minutes at load 9 on 2 cores): wait rather than fail
    inference = InferenceConfig(max_model_len=1024, max_lora_rank=lora_rank, startup_timeout_s=900.0)
    backend = LocalBackend(root, inference=inference)
    model_dir = backend.model_dir(model)
    shutil.rmtree(model_dir, ignore_errors=True)  # every run trains from step 0
    db_path = build_database(model_dir / "shop.sqlite", seed=seed)  # the SQLite environment's shop
    asked = questions(db_path, seed)
    tools = [convert_to_openai_tool(t) for t in order_tools(db_path)]  # as the graph's ChatOpenAI sends them
    exporter = langfuse_exporter()
    lap("tiny model", since)
    async with backend:
        print("2/4 starting vLLM and loading the trainer ...", flush=True)
        since = time.perf_counter()
        await with_clock("    vLLM starting", model.register(backend))
        print(
            f"    ready in {lap('vLLM + trainer', since):.0f} s; warm start on the tool-call format",
            flush=True,
        )
        since = time.perf_counter()
        sft = await warm_start(
            backend,
            model,
            warm_start_examples(db_path, tools, SYSTEM, warm_examples, seed),
            SFTConfig(learning_rate=warm_learning_rate, epochs=warm_epochs, batch_size=16, seed=seed),
        )
        print(
            f"    warm start: {sft['batches']} SFT steps, final loss {sft['final_loss']:.3f} "
            f"({lap('warm start', since):.0f} s; each question calls each of the four tools equally often)",
            flush=True,
        )
        rollout = make_rollout(model, db_path)
        overlap = " (async: rollouts never wait for a step)" if async_mode else ""
        first = (
            math.ceil((decay_start or 0.0) * steps) + 2
        )  # in the table's numbers: the warm start is step 1
        falls = "" if decay_start is None else f", falling to a tenth over steps {first}-{steps + 1}"
        print(f"3/4 GRPO steps{overlap} (learning rate {learning_rate:g}{falls}):", flush=True)
        print(
            f"{'step':>4} {'success':>7} {'reward':>7} {'loss':>8} {'grad':>7} {'clip':>6} {'tokens':>7} {'swap':>8} {'sec':>6}"
        )
        curve: list[tuple[int, float]] = []
        config = TrainConfig(learning_rate=learning_rate, seed=seed)

        def show(step: int, metrics: dict[str, float], swap: float, seconds: float) -> None:
            success = metrics.get("metric/success", metrics.get("train/metric/success", 0.0))
            curve.append((step - 1, success))
            print(
                f"{step:>4} {success:>7.3f} {metrics.get('reward_mean', metrics.get('train/reward', 0.0)):>7.3f} "
                f"{metrics.get('loss', 0.0):>8.4f} {metrics.get('grad_norm', 0.0):>7.3f} "
                f"{metrics.get('clip_fraction', 0.0):>6.3f} {int(metrics.get('trained_tokens', 0)):>7d} "
                f"{swap:>8.1e} {seconds:>6.1f}",
                flush=True,
            )

        since = time.perf_counter()
        if async_mode:
            await train_async_steps(
                model, backend, config, steps, group_size, seed, rollout, asked, show, exporter
            )
        else:
            for _ in range(steps):
                t0 = time.perf_counter()
                if exporter is not None:
                    exporter.step, exporter.split = await model.get_step(), "train"
                step_seed = (seed + 1) * 1_000_003 + len(curve) * 10_007
                groups = await gather_trajectory_groups(
                    question_groups(rollout, asked, group_size, step_seed),
                    pbar_desc="rollouts",
                    after_each=exporter.after_each if exporter is not None else None,
                )
                rate = step_rate(len(curve), steps, learning_rate, decay_start)
                metrics = await model.train(groups, config=config.model_copy(update={"learning_rate": rate}))
                swap = await served_swap(backend, model, groups)
                show(await model.get_step(), metrics, swap, time.perf_counter() - t0)
        lap("GRPO steps", since)
        since = time.perf_counter()
        print(
            "4/4 evaluation: the warm start (step 1) against the trained adapter, the same draws", flush=True
        )
        evaluation = await evaluate_demo(
            model, rollout, asked, eval_samples, seed, exporter, model_dir / "evaluation.json"
        )
        lap("evaluations", since)
    start, end = evaluation.targets[0], evaluation.targets[-1]
    gain = evaluation.comparisons[0]
    success_start, success_end = float(start.success_rate or 0.0), float(end.success_rate or 0.0)
    print(
        f"    success {success_start:.3f} at {start.target} -> {success_end:.3f} at {end.target}; reward "
        f"gain {gain.diff.mean:+.3f} [95 % CI {gain.diff.low:+.3f}, {gain.diff.high:+.3f}] over "
        f"{start.scenarios} questions x {evaluation.attempts_per_scenario} attempts (paired, bootstrap over "
        f"questions); {len(gain.changes.improved)} improved, {len(gain.changes.worse)} worse",
        flush=True,
    )
    curve_path = Path(out) if out else model_dir / "success.png"
    plot_curve(curve, curve_path, f"art-adapters demo: the LangGraph order agent ({family})")
    print(f"success curve: {curve_path}")
    report = write_report(model_dir)
    if exporter is not None:
        exporter.close(timeout_s=10.0)
    for line in where_to_look(report, exporter):
        print(line)
    total = time.perf_counter() - started
    print("time: " + ", ".join(f"{phase} {value:.0f} s" for phase, value in seconds.items()))
    result = {
        "success_start": success_start,
        "success_end": success_end,
        "gain": gain.diff.mean,
        "gain_ci_low": gain.diff.low,
        "gain_ci_high": gain.diff.high,
        "steps": steps,  # GRPO steps (the warm start is one more checkpoint)
        "seconds": total,
    }
    (model_dir / "demo.json").write_text(
        json.dumps({**result, "curve": curve, "phase_seconds": seconds}, indent=2) + "\n"
    )
    return result


async def train_async_steps(
    model: TrainableModel,
    backend: Any,
    config: TrainConfig,
    steps: int,
    group_size: int,
    seed: int,
    rollout: Any,
    asked: list[Question],
    show: Any,
    exporter: Any = None,
) -> list[Any]:
    """The sync loop's groups (the same seeds, question after question), rolled out while the trainer steps;
    each group goes to Langfuse (when on) under the step the model was at when it finished."""

    def scenarios() -> Any:
        for k in range(10**9):
            step_seed = (seed + 1) * 1_000_003 + (k // len(asked)) * 10_007
            yield asked[k % len(asked)], step_seed + 2 * (k % len(asked)) * group_size

    async def rollout_group(model: TrainableModel, scenario: tuple[Question, int]) -> TrajectoryGroup:
        question, first_seed = scenario
        group = TrajectoryGroup(rollout(question, first_seed + 2 * i) for i in range(group_size))
        done = (await gather_trajectory_groups([group], pbar_desc=None))[0]
        if exporter is not None:
            exporter.step, exporter.split = await model.get_step(), "train"
            exporter.after_each(done)
        return done

    return await pipeline_steps(model, backend, config, steps, len(asked), scenarios(), rollout_group, show)


def run_demo_command(
    path: str = ".art",
    steps: int | None = None,
    out: str | None = None,
    family: str = "byte",
    warm_epochs: int | None = None,
    async_mode: bool = False,
) -> None:
    options: dict[str, Any] = {"steps": steps, "warm_epochs": warm_epochs}
    given = {k: v for k, v in options.items() if v}
    if async_mode:
        given["decay_start"] = None  # one constant rate: train_async steps on one TrainConfig
    result = asyncio.run(run_demo(path, out=out, family=family, async_mode=async_mode, **given))
    print(
        f"demo result: success_start={result['success_start']:.3f} success_end={result['success_end']:.3f} "
        f"steps={int(result['steps'])} seconds={result['seconds']:.1f}"
    )
