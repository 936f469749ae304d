"""The demo's first task, kept for the async benchmark and the server tests: a hand-written rollout on the recording
client learns which of 4 tools answers an order question (`art-adapters demo` trains the LangGraph agent instead)."""

from __future__ import annotations

import random
from typing import Any

from ..capture import capture
from ..config import TrainConfig
from ..gather import gather_trajectory_groups
from ..model import TrainableModel
from ..trajectories import Trajectory, TrajectoryGroup
from .steps import pipeline_steps

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
    """The sync steps' work with rollouts that never wait for training (`steps.pipeline_steps`), on the same seeds."""

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

    return await pipeline_steps(
        model,
        backend,
        config,
        steps,
        len(SCENARIOS),
        scenarios(),
        rollout_group,
        show,
        max_steps_off_policy=max_steps_off_policy,
    )
