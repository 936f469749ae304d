"""Replay: production traces as scenarios for ordinary GRPO rollouts. A scenario is the conversation up to the
user's turn, the tools the agent had, and the tools' recorded results as a fixture environment (the same call
gets the same result; a call production never made gets `unknown_result`)."""

from __future__ import annotations

import json
import math
from collections import Counter
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
            for call, result in recorded_results(conversation):
                function = call.get("function") or {}
                content = result.get("content")
                fixtures.setdefault(
                    call_key(function.get("name", ""), function.get("arguments")),
                    content if isinstance(content, str) else json.dumps(content),
                )
        final = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        start = json.dumps([messages[: first_user + 1], trajectory.tools], sort_keys=True, default=str)
        if unique and start in seen:
            known = seen[start]
            known.fixtures = {**fixtures, **known.fixtures}
            best = -math.inf if known.recorded_reward is None else known.recorded_reward  # 0.0 is a reward
            if math.isfinite(trajectory.reward) and trajectory.reward > best:
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


def recorded_results(conversation: list[Message]) -> list[tuple[dict[str, Any], Message]]:
    """Each tool call of the conversation with the tool message that answered it. A call is answered in its own
    turn (the tool messages after its assistant message, before the next one): by its id where that id names one
    call of the turn, else by position among the turn's results left (providers that number ids per turn, such as
    `call_0` every turn, or send none). A call no result answered is left out."""
    pairs: list[tuple[dict[str, Any], Message]] = []
    for index, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        if not calls:
            continue
        results: list[Message] = []
        for later in conversation[index + 1 :]:
            if later.get("role") == "assistant":
                break
            if later.get("role") == "tool":
                results.append(later)
        ids = Counter(c.get("id") for c in calls)
        answered: dict[int, Message] = {}
        for k, call in enumerate(calls):
            if call.get("id") and ids[call.get("id")] == 1:
                found = next((r for r in results if r.get("tool_call_id") == call.get("id")), None)
                if found is not None:
                    answered[k] = found
                    results = [r for r in results if r is not found]
        left = iter(results)
        for k, call in enumerate(calls):
            result = answered.get(k) or next(left, None)
            if result is not None:
                pairs.append((call, result))
    return pairs


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
