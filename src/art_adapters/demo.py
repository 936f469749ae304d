"""`art-adapters demo`: real RL on the offline tiny model: a tool-using agent learns which tool answers which request.

Reads top to bottom like nanochat's chat_rl.py: warm start, then rollouts -> GRPO step -> hot-swapped adapter.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from .capture import capture
from .config import LoRAConfig, SFTConfig, TrainConfig
from .gather import gather_trajectory_groups
from .model import TrainableModel
from .progress import live_display, progress_bar
from .trajectories import Trajectory, TrajectoryGroup

# --- the task: a support agent with 4 tools; every request is about an order, which one tool can answer --------
# Each name is ONE token of the tiny tokenizer, so the choice is one sampled token (multi-token names let RL mix
# fragments of names); a description, because vLLM renders a missing one as `"description": null`.
TOOL_DESCRIPTIONS = {
    "query": "look up an order",
    "day": "today's date",
    "fun": "a joke",
    "capital": "a capital city",
}
TOOL_NAMES = list(TOOL_DESCRIPTIONS)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": name, "description": text, "parameters": {"type": "object", "properties": {}}},
    }
    for name, text in TOOL_DESCRIPTIONS.items()
]
SCENARIOS: list[tuple[str, str]] = [
    ("Where is my order?", "query"),
    ("Has my parcel shipped?", "query"),
    ("When will my package arrive?", "query"),
    ("Is order 42 on its way?", "query"),
    ("Track my delivery.", "query"),
    ("Did you send my order?", "query"),
    ("What is my order status?", "query"),
    ("My package is late.", "query"),
]
SYSTEM = "You are a support agent. Call one tool."
TOOL_RESULTS = {"query": "shipped", "day": "Monday", "fun": "a pun", "capital": "Paris"}


def scenario_messages(request: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request}]


def warm_start_examples(count: int, seed: int = 0, labelled: float = 0.0) -> list[Trajectory]:
    """Warm-start data: the tool-call format, with the right tool in only `labelled` of the examples (by default
    none: every tool is drawn at random), so the agent starts near chance (1 in 4) and RL must learn the choice."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        request, target = SCENARIOS[i % len(SCENARIOS)]
        name = target if rng.random() < labelled else rng.choice(TOOL_NAMES)
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        messages = [
            *scenario_messages(request),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULTS[name]},
            {"role": "assistant", "content": f"It is {TOOL_RESULTS[name]}."},
        ]
        out.append(Trajectory(messages_and_choices=messages, tools=TOOLS, reward=1.0))
    return out


# --- one rollout: the agent calls a tool, reads its result and answers -------------------------------------------
async def rollout(model: TrainableModel, request: str, target: str, seed: int | None = None) -> Trajectory:
    """With a `seed`, sampling is seeded per rollout (vLLM's per-request `seed`), so a run repeats."""
    client = model.openai_client()
    messages = scenario_messages(request)
    async with capture() as trajectory:
        first = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            tools=TOOLS,
            max_tokens=32,
            temperature=1.0,  # type: ignore[arg-type]
            seed=seed,
        )
        message = first.choices[0].message
        calls = message.tool_calls or []
        called = getattr(calls[0], "function", None) if calls else None
        name = called.name if called is not None else None
        if calls:
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            result = TOOL_RESULTS.get(name or "", "unknown tool")
            messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": result})
            await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=messages,
                tools=TOOLS,
                max_tokens=8,
                temperature=1.0,  # type: ignore[arg-type]
                seed=None if seed is None else seed + 1,
            )
    success = name == target and len(calls) == 1
    # Shaped: a well-formed call of the wrong tool earns a little, so a broken call is the worst outcome.
    trajectory.reward = 1.0 if success else 0.2 if calls else 0.0
    trajectory.metrics["success"] = float(success)
    trajectory.metrics["called_tool"] = float(bool(calls))
    trajectory.metadata["target"] = target
    return trajectory


def scenario_groups(model: TrainableModel, size: int, seed: int) -> list[TrajectoryGroup]:
    return [
        TrajectoryGroup(rollout(model, r, t, seed + 2 * (s * size + i)) for i in range(size))
        for s, (r, t) in enumerate(SCENARIOS)
    ]


async def evaluate(model: TrainableModel, samples_per_scenario: int, seed: int) -> float:
    """Success rate (the right tool, called once) over every scenario at temperature 1; logged as `val`."""
    groups = await gather_trajectory_groups(
        scenario_groups(model, samples_per_scenario, seed), pbar_desc="eval"
    )
    metrics = await model.log(groups, split="val")
    return float(metrics["val/metric/success"])


async def served_swap(backend: Any, model: TrainableModel, groups: list[TrajectoryGroup]) -> float:
    """Max |vLLM - trainer| logprob on a sampled sequence under the newest version: the swap really happened."""
    probe = next(c for g in groups for t in g for c in t.llm_calls if c.completion_token_ids)
    sequence = [*(probe.prompt_token_ids or []), *(probe.completion_token_ids or [])]
    return float(await backend.served_logprob_diff(model, sequence))


async def train_demo_async(
    model: TrainableModel,
    backend: Any,
    config: TrainConfig,
    steps: int,
    group_size: int,
    seed: int,
    show: Any,
    *,
    max_steps_off_policy: int = 1,
) -> list[Any]:
    """The same steps with rollouts that never wait for training: every scenario's group is rolled out while the
    trainer steps on the groups before it (at most `max_steps_off_policy` steps stale)."""
    from .pipeline import PipelineConfig, train_async

    def scenarios() -> Any:
        for k in range(10**9):  # the sync loop's seeds, scenario after scenario
            request, target = SCENARIOS[k % len(SCENARIOS)]
            step_seed = (seed + 1) * 1_000_003 + (k // len(SCENARIOS)) * 10_007
            yield request, target, step_seed + 2 * (k % len(SCENARIOS)) * group_size

    async def rollout_group(model: TrainableModel, scenario: tuple[str, str, int]) -> TrajectoryGroup:
        request, target, first_seed = scenario
        group = TrajectoryGroup(
            rollout(model, request, target, first_seed + 2 * i) for i in range(group_size)
        )
        return (await gather_trajectory_groups([group], pbar_desc=None))[0]

    last = time.perf_counter()

    async def on_step(report: Any, batch: list[TrajectoryGroup]) -> None:
        nonlocal last
        if show is not None:
            swap = await served_swap(backend, model, batch)
            show(report.step, report.metrics, swap, time.perf_counter() - last)
        last = time.perf_counter()

    pipeline = PipelineConfig(
        rollout_workers=len(SCENARIOS),
        groups_per_step=len(SCENARIOS),
        max_steps_off_policy=max_steps_off_policy,
        max_steps=steps,
    )
    return await train_async(
        model, rollout_group, scenarios(), config=config, pipeline=pipeline, on_step=on_step, resume=False
    )


# --- showing where the time goes --------------------------------------------------------------------------------
async def with_clock(description: str, work: Any) -> Any:
    """Await `work` while a live line counts the seconds (in a terminal; nothing in a log)."""
    from tqdm.auto import tqdm

    clock = tqdm(desc=description, bar_format="{desc} {elapsed}", disable=not live_display(), leave=False)

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.5)
            clock.refresh()

    ticking = asyncio.ensure_future(tick())
    try:
        return await work
    finally:
        ticking.cancel()
        clock.close()


async def warm_start(
    backend: Any, model: TrainableModel, examples: list[Trajectory], config: SFTConfig
) -> Any:
    """`model.train_sft`, with a bar over its batches."""
    result: dict[str, Any] = {}
    bar = None
    async for event in backend.train_sft_events(model, examples, config):
        if event["event"] == "started":
            bar = progress_bar(int(event["batches"]), "warm start", "batch")
        elif event["event"] == "batch" and bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{event['loss']:.3f}", refresh=False)
        elif event["event"] == "done":
            result = event.get("metrics", {})
    if bar is not None:
        bar.close()
    return result


# --- the run ----------------------------------------------------------------------------------------------------
async def run_demo(
    path: str | Path = ".art",
    *,
    steps: int = 12,
    group_size: int = 8,
    learning_rate: float = 1.5e-3,
    lora_rank: int = 16,
    warm_examples: int = 64,
    warm_epochs: int = 32,
    warm_learning_rate: float = 5e-3,
    eval_samples: int = 8,
    out: str | Path | None = None,
    seed: int = 0,
    family: str = "byte",
    async_mode: bool = False,
) -> dict[str, float]:
    from .backend.local import LocalBackend
    from .inference import InferenceConfig
    from .tiny import tiny_model_path

    started = time.perf_counter()
    seconds: dict[str, float] = {}  # where the time went, by phase

    def lap(phase: str, since: float) -> float:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - since
        return seconds[phase]

    root = Path(path)
    print(f"1/4 the offline tiny model, {family} tokenizer (built once, cached) ...", flush=True)
    since = time.perf_counter()
    model = TrainableModel(
        name="tool-agent" if family == "byte" else f"tool-agent-{family}",
        project="demo",
        base_model=str(tiny_model_path(family)),
        lora=LoRAConfig(rank=lora_rank, alpha=2 * lora_rank),
    )
    backend = LocalBackend(root, inference=InferenceConfig(max_model_len=1024, max_lora_rank=lora_rank))
    shutil.rmtree(backend.model_dir(model), ignore_errors=True)  # every run trains from step 0
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
            warm_start_examples(warm_examples, seed),
            SFTConfig(learning_rate=warm_learning_rate, epochs=warm_epochs, batch_size=16, seed=seed),
        )
        print(
            f"    warm start: {sft['batches']} SFT steps, final loss {sft['final_loss']:.3f} "
            f"({lap('warm start', since):.0f} s; the tool in each example drawn at random)",
            flush=True,
        )
        since = time.perf_counter()
        success_start = await evaluate(model, eval_samples, seed=seed * 7919 + 1)
        lap("evaluations", since)
        overlap = " (async: rollouts never wait for a step)" if async_mode else ""
        print(f"3/4 success at step 0: {success_start:.3f}; GRPO steps{overlap}:", flush=True)
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
            await train_demo_async(model, backend, config, steps, group_size, seed, show)
        else:
            for _ in range(steps):
                t0 = time.perf_counter()
                step_seed = (seed + 1) * 1_000_003 + len(curve) * 10_007
                groups = await gather_trajectory_groups(
                    scenario_groups(model, group_size, step_seed), pbar_desc="rollouts"
                )
                metrics = await model.train(groups, config=config)
                swap = await served_swap(backend, model, groups)
                show(await model.get_step(), metrics, swap, time.perf_counter() - t0)
        lap("GRPO steps", since)
        since = time.perf_counter()
        success_end = await evaluate(model, eval_samples, seed=seed * 7919 + 1)
        lap("evaluations", since)
        final_step = await model.get_step()
    print(f"4/4 success at step {final_step}: {success_end:.3f}")
    curve_path = Path(out) if out else backend.model_dir(model) / "reward.png"
    plot_curve(curve, curve_path, family)
    print(f"reward curve: {curve_path}")
    total = time.perf_counter() - started
    print("time: " + ", ".join(f"{phase} {value:.0f} s" for phase, value in seconds.items()))
    result = {
        "success_start": success_start,
        "success_end": success_end,
        "steps": steps,  # GRPO steps (the warm start is one more checkpoint)
        "seconds": total,
    }
    (backend.model_dir(model) / "demo.json").write_text(
        json.dumps({**result, "curve": curve, "phase_seconds": seconds}, indent=2) + "\n"
    )
    return result


def plot_curve(curve: list[tuple[int, float]], path: Path, family: str = "byte") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("success rate (rollouts)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"art-adapters demo: tool choice on the tiny model ({family})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    result = asyncio.run(run_demo(path, out=out, family=family, async_mode=async_mode, **given))
    print(
        f"demo result: success_start={result['success_start']:.3f} success_end={result['success_end']:.3f} "
        f"steps={int(result['steps'])} seconds={result['seconds']:.1f}"
    )
