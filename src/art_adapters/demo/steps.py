"""The demo's machinery shared by its tasks: the SFT warm start with a bar, the live clock, the swap check, async
steps through the pipeline, and the reward-curve PNG."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import SFTConfig, TrainConfig
from ..model import TrainableModel
from ..progress import live_display, progress_bar
from ..trajectories import Trajectory, TrajectoryGroup

Show = Callable[[int, dict[str, float], float, float], None]


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
) -> dict[str, Any]:
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


async def served_swap(backend: Any, model: TrainableModel, groups: list[TrajectoryGroup]) -> float:
    """Max |vLLM - trainer| logprob on a sampled sequence under the newest version: the swap really happened."""
    probe = next(c for g in groups for t in g for c in t.llm_calls if c.completion_token_ids)
    sequence = [*(probe.prompt_token_ids or []), *(probe.completion_token_ids or [])]
    return float(await backend.served_logprob_diff(model, sequence))


async def pipeline_steps(
    model: TrainableModel,
    backend: Any,
    config: TrainConfig,
    steps: int,
    groups_per_step: int,
    scenarios: Iterator[Any],
    rollout_group: Callable[[TrainableModel, Any], Awaitable[TrajectoryGroup]],
    show: Show | None,
    *,
    max_steps_off_policy: int = 1,
) -> list[Any]:
    """`steps` training steps of `groups_per_step` groups each, with rollouts that never wait for training: each
    scenario's group is rolled out while the trainer steps on the groups before it (at most
    `max_steps_off_policy` steps stale). Ends early when 10 steps' worth of groups in a row had equal rewards."""
    from ..pipeline import PipelineConfig, train_async

    last = time.perf_counter()

    async def on_step(report: Any, batch: list[TrajectoryGroup]) -> None:
        nonlocal last
        if show is not None:
            swap = await served_swap(backend, model, batch)
            show(report.step, report.metrics, swap, time.perf_counter() - last)
        last = time.perf_counter()

    pipeline = PipelineConfig(
        rollout_workers=groups_per_step,
        groups_per_step=groups_per_step,
        max_steps_off_policy=max_steps_off_policy,
        max_steps=steps,
        # every group scoring alike (a policy that never calls a tool) trains nothing: stop after 10 steps' worth
        # of them in a row rather than roll out forever
        max_zero_variance_groups=10 * groups_per_step,
    )
    return await train_async(
        model, rollout_group, scenarios, config=config, pipeline=pipeline, on_step=on_step, resume=False
    )


def plot_curve(curve: list[tuple[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("success rate (rollouts)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
