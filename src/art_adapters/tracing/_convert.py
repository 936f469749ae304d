"""Trajectory -> trace plan: the observations, times and scores one trajectory becomes (no tracing SDK needed)."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..trajectories import LLMCall, Message, Trajectory

_PARAM_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "logprobs",
    "top_logprobs",
    "tool_choice",
)


@dataclass
class Obs:
    """One observation to send: its type, name, real times (ns) and payload."""

    kind: str  # "agent" | "generation" | "tool"
    name: str
    start_ns: int
    end_ns: int
    input: Any = None
    output: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    model_parameters: dict[str, Any] | None = None
    usage: dict[str, int] | None = None
    level: str | None = None
    status_message: str | None = None
    call: LLMCall | None = None


@dataclass
class TracePlan:
    """Everything one trajectory's trace holds."""

    trace_id: str
    root: Obs
    children: list[Obs]
    scores: list[tuple[str, float, str]]
    session_id: str | None
    tags: list[str]
    trace_metadata: dict[str, str]
    trace_name: str = "rollout"


def new_trace_id() -> str:
    """A Langfuse/OTel trace id: 32 lowercase hex characters."""
    return secrets.token_hex(16)


def ns(t: float) -> int:
    return int(t * 1_000_000_000)


def _content_text(content: Any) -> Any:
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(texts) if texts else content
    return content


def first_user_content(messages: list[Message]) -> Any:
    return next((_content_text(m.get("content")) for m in messages if m.get("role") == "user"), None)


def last_assistant(messages: list[Message]) -> Message | None:
    return next((m for m in reversed(messages) if m.get("role") == "assistant"), None)


def _finish_reason(call: LLMCall) -> str | None:
    for choice in call.choices():
        if choice.get("index", 0) == 0:
            return choice.get("finish_reason")
    return None


def usage_of(call: LLMCall) -> dict[str, int]:
    usage = (call.response or {}).get("usage") or {}
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if prompt is None and call.prompt_token_ids is not None:
        prompt = len(call.prompt_token_ids)
    if completion is None and call.completion_token_ids is not None:
        completion = len(call.completion_token_ids)
    out = {k: int(v) for k, v in (("input", prompt), ("output", completion)) if v is not None}
    total = usage.get("total_tokens")
    if total is None and out:
        total = sum(out.values())
    if total is not None:
        out["total"] = int(total)
    return out


def model_parameters(request: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key in _PARAM_KEYS:
        value = request.get(key)
        if value is None:
            continue
        params[key] = value if isinstance(value, str | int | float | bool) else json.dumps(value)
    return params


def model_name(call: LLMCall, step: int | None) -> str | None:
    """The call's model, as `name@step` when a step is known and the name does not carry one."""
    model = call.model or (call.response or {}).get("model")
    if model and step is not None and "@" not in model:
        return f"{model}@{step}"
    return model


def generation_obs(call: LLMCall, index: int, step: int | None, history: int | None = None) -> Obs:
    metadata: dict[str, Any] = {
        "call_index": index,
        "finish_reason": _finish_reason(call),
        "prompt_tokens": len(call.prompt_token_ids) if call.prompt_token_ids is not None else None,
        "completion_tokens": len(call.completion_token_ids)
        if call.completion_token_ids is not None
        else None,
        "has_logprobs": call.logprobs is not None,
        "stream": call.stream,
        "status_code": call.status_code,
        "latency_s": round(call.latency_s, 6),
        "url": call.url or None,
    }
    if call.request_tools():
        metadata["tools"] = [(t.get("function") or {}).get("name") for t in call.request["tools"]]
    if history is not None:
        metadata["history"] = history
    return Obs(
        kind="generation",
        name="chat" if history is None else f"chat/history-{history}",
        start_ns=ns(call.started_at),
        end_ns=ns(call.ended_at),
        input=call.request_messages(),
        output=call.response_message(),
        metadata={k: v for k, v in metadata.items() if v is not None},
        model=model_name(call, step),
        model_parameters=model_parameters(call.request) or None,
        usage=usage_of(call) or None,
        level="ERROR" if call.error else None,
        status_message=call.error,
        call=call,
    )


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def tool_obs(messages: list[Message], calls: list[LLMCall], start: float, end: float) -> list[Obs]:
    """One tool observation per assistant tool call, with its result matched by tool_call_id.

    Times: from the end of the LLM call that emitted the tool call to the start of the first call that saw the
    result (the tool ran in between); the trajectory's bounds where no call shows it.
    """
    results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    emitted: dict[str, float] = {}
    consumed: dict[str, float] = {}
    for call in calls:
        answer = call.response_message() or {}
        for tc in answer.get("tool_calls") or []:
            emitted.setdefault(tc.get("id"), call.ended_at)
        for m in call.request_messages():
            if m.get("role") == "tool":
                consumed.setdefault(m.get("tool_call_id"), call.started_at)
    out: list[Obs] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for tc in message.get("tool_calls") or []:
            call_id = tc.get("id")
            function = tc.get("function") or {}
            t0 = emitted.get(call_id, start)
            t1 = consumed.get(call_id, end if call_id in results else t0)
            result = results.get(call_id)
            out.append(
                Obs(
                    kind="tool",
                    name=function.get("name") or "tool",
                    start_ns=ns(t0),
                    end_ns=ns(max(t0, t1)),
                    input=_arguments(function.get("arguments")),
                    output=_content_text(result.get("content")) if result else None,
                    metadata={"tool_call_id": call_id, "answered": result is not None},
                    level=None if result is not None else "WARNING",
                    status_message=None if result is not None else "no tool result in the conversation",
                )
            )
    return out


def scores_of(trajectory: Trajectory) -> list[tuple[str, float, str]]:
    """(name, value, data type): the reward and each finite metric."""
    scores: list[tuple[str, float, str]] = []
    if math.isfinite(trajectory.reward):
        scores.append(("reward", float(trajectory.reward), "NUMERIC"))
    for name, value in trajectory.metrics.items():
        if isinstance(value, bool):
            scores.append((name, 1.0 if value else 0.0, "BOOLEAN"))
        elif isinstance(value, int | float) and math.isfinite(value):
            scores.append((name, float(value), "NUMERIC"))
    return scores


def plan_trace(
    trajectory: Trajectory,
    *,
    trace_id: str,
    step: int | None = None,
    split: str | None = None,
    group_index: int | None = None,
    trajectory_index: int | None = None,
    project: str | None = None,
    session_id: str | None = None,
    tags: list[str] | None = None,
) -> TracePlan:
    messages = trajectory.messages()
    calls = list(trajectory.llm_calls)
    children = [generation_obs(c, i, step) for i, c in enumerate(calls)]
    for h, history in enumerate(trajectory.additional_histories):
        children += [generation_obs(c, i, step, history=h) for i, c in enumerate(history.llm_calls)]
    start = min([trajectory.start_time] + [c.started_at for c in calls])
    end = max([trajectory.end_time or trajectory.start_time] + [c.ended_at for c in calls])
    children += tool_obs(messages, calls, start, end)
    for history in trajectory.additional_histories:
        children += tool_obs(history.messages(), history.llm_calls, start, end)
    where = {
        "step": step,
        "split": split,
        "group_index": group_index,
        "trajectory_index": trajectory_index,
        "project": project,
    }
    where = {k: v for k, v in where.items() if v is not None}
    root = Obs(
        kind="agent",
        name="agent",
        start_ns=ns(start),
        end_ns=ns(end),
        input={"scenario": first_user_content(messages), "metadata": dict(trajectory.metadata)},
        output=last_assistant(messages),
        metadata={
            **where,
            "reward": trajectory.reward,
            "metrics": dict(trajectory.metrics),
            "llm_calls": len(calls),
            "messages": len(messages),
            **({"logs": trajectory.logs[-20:]} if trajectory.logs else {}),
        },
    )
    all_tags = ([split] if split else []) + ([f"step:{step}"] if step is not None else []) + list(tags or [])
    return TracePlan(
        trace_id=trace_id,
        root=root,
        children=children,
        scores=scores_of(trajectory),
        session_id=session_id,
        tags=all_tags,
        trace_metadata={k: str(v)[:200] for k, v in where.items()},
    )
