"""Replay: production traces as scenarios for ordinary GRPO rollouts. A scenario is the conversation up to the
user's turn, the tools the agent had, and the tools' recorded results as a fixture environment (the same call
gets the same result; a call production never made gets `unknown_result`)."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import BaseModel, Field

from ..trajectories import Message, Trajectory

RewardFn = Callable[["ReplayScenario", Trajectory], "float | Awaitable[float]"]


class ReplayScenario(BaseModel):
    """One production conversation to replay."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    fixtures: dict[str, str] = Field(default_factory=dict)  # tool call key -> the recorded result
    recorded_answer: str | None = None
    recorded_reward: float | None = None
    trace_id: str | None = None
    unknown_result: str = "error: no recorded result for this call"

    def tool_result(self, name: str, arguments: Any) -> str:
        """The recorded result of the tool call `name(arguments)` (arguments as JSON text or a dict)."""
        return self.fixtures.get(call_key(name, arguments), self.unknown_result)


def call_key(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{name}:{arguments}"
    return f"{name}:{json.dumps(arguments, sort_keys=True, separators=(',', ':'))}"


def replay_scenarios(trajectories: Iterable[Trajectory], *, unique: bool = True) -> list[ReplayScenario]:
    """A scenario per trajectory that has a user turn: its messages up to and including the first user message,
    its tools, and every tool result it recorded (its main conversation and its histories). `unique`: one
    scenario per distinct start (the best-rewarded trace's answer kept as the recorded one, every trace's tool
    results pooled)."""
    out: list[ReplayScenario] = []
    seen: dict[str, ReplayScenario] = {}
    for trajectory in trajectories:
        messages = trajectory.messages()
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first_user is None:
            continue
        fixtures: dict[str, str] = {}
        for conversation in [messages, *(h.messages() for h in trajectory.additional_histories)]:
            results = {m.get("tool_call_id"): m for m in conversation if m.get("role") == "tool"}
            for message in conversation:
                for call in message.get("tool_calls") or []:
                    result = results.get(call.get("id"))
                    function = call.get("function") or {}
                    if result is not None:
                        content = result.get("content")
                        fixtures[call_key(function.get("name", ""), function.get("arguments"))] = (
                            content if isinstance(content, str) else json.dumps(content)
                        )
        final = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        start = json.dumps([messages[: first_user + 1], trajectory.tools], sort_keys=True, default=str)
        if unique and start in seen:
            known = seen[start]
            known.fixtures = {**fixtures, **known.fixtures}
            if math.isfinite(trajectory.reward) and trajectory.reward > (known.recorded_reward or -math.inf):
                known.recorded_reward = trajectory.reward
                known.recorded_answer = None if final is None else str(final.get("content") or "")
            continue
        out.append(
            ReplayScenario(
                messages=messages[: first_user + 1],
                tools=trajectory.tools or _tools_of(trajectory),
                fixtures=fixtures,
                recorded_answer=None if final is None else str(final.get("content") or ""),
                recorded_reward=trajectory.reward if math.isfinite(trajectory.reward) else None,
                trace_id=str(trajectory.metadata.get("trace_id") or "") or None,
            )
        )
        seen[start] = out[-1]
    return out


def _tools_of(trajectory: Trajectory) -> list[dict[str, Any]] | None:
    for call in trajectory.llm_calls:
        tools = call.request_tools()
        if tools:
            return tools
    return None


def same_answer(scenario: ReplayScenario, trajectory: Trajectory) -> float:
    """1.0 when the final answer equals the recorded one of a trace that scored well (>= 0.5), else 0.0."""
    final = next((m for m in reversed(trajectory.messages()) if m.get("role") == "assistant"), None)
    if final is None or scenario.recorded_answer is None or (scenario.recorded_reward or 0.0) < 0.5:
        return 0.0
    return float(str(final.get("content") or "").strip() == scenario.recorded_answer.strip())


async def replay_rollout(
    model: Any,
    scenario: ReplayScenario,
    *,
    reward_fn: RewardFn = same_answer,
    max_turns: int = 8,
    **sampling: Any,
) -> Trajectory:
    """One rollout of the model on a replayed scenario: it samples, its tool calls are answered from the fixtures,
    until it answers without a tool call (or `max_turns`); then `reward_fn(scenario, trajectory)`."""
    client = model.openai_client()
    trajectory = Trajectory(
        messages_and_choices=list(scenario.messages),
        tools=scenario.tools,
        metadata={"replay_of": scenario.trace_id or ""},
    )
    for _ in range(max_turns):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            **({"tools": scenario.tools} if scenario.tools else {}),
            **sampling,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        calls = choice.message.tool_calls or []
        if not calls:
            break
        for call in calls:
            function = getattr(call, "function", None)
            name = getattr(function, "name", "") or ""
            result = scenario.tool_result(name, getattr(function, "arguments", "{}"))
            trajectory.messages_and_choices.append(
                {"role": "tool", "tool_call_id": call.id, "content": result}
            )
    reward = reward_fn(scenario, trajectory)
    trajectory.reward = float(await reward if isinstance(reward, Awaitable) else reward)
    return trajectory.finish()
