"""Trajectory -> trace plan: the observations, times and scores one trajectory becomes (no tracing SDK needed)."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..trajectories import LLMCall, Message, Trajectory, reward_missing
from ._records import CALL_KEY, TRAJECTORY_KEY, pack_call, pack_trajectory, trajectory_calls

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
    key: str | None = None  # a container's id (a graph node run, an agent's turn), children point to it
    parent: str | None = None  # the container this observation sits under (None: the trajectory's root)


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
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))  # chat; Responses and Anthropic Messages
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
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
    """The call's model, as `name@version`: the version that sampled it (from the gateway), else the step the
    rollout ran at, when the name does not carry one."""
    model = call.model or (call.response or {}).get("model")
    version = call.policy_version if call.policy_version is not None else step
    if model and version is not None and "@" not in model:
        return f"{model}@{version}"
    return model


def generation_obs(
    call: LLMCall, index: int, step: int | None, history: int | None = None, record: str | None = None
) -> Obs:
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
        "policy_version": call.policy_version,  # the weights that sampled this call
        "served_model": call.served_model,
        # the adapter that served it (per-agent adapters: `{project}/{name}.{agent}`), filterable without a version
        "adapter": call.served_model.partition("@")[0] if call.served_model else None,
    }
    if call.request_tools():
        metadata["tools"] = [(t.get("function") or {}).get("name") for t in call.request["tools"]]
    if history is not None:
        metadata["history"] = history
    source = call.source.model_dump(exclude_defaults=True)
    if source:
        metadata["source"] = source
    if call.source.role:
        metadata["role"] = call.source.role
    if record is not None:
        metadata[CALL_KEY] = record
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


def container_path(call: LLMCall) -> list[tuple[str, str, str]]:
    """(kind, name, key) of the observations a call nests under, outermost first: a LangGraph node run (and the
    subgraph nodes around it), or the Agents SDK agents it runs under (an agent used as a tool inside its caller).
    Keys tell runs apart: checkpoint namespaces for nodes; for agents the agent path (an agent's turns share one)."""
    source = call.source
    if source.node is not None:
        parts = [p for p in (source.checkpoint_ns or "").split("|") if p]
        out = [("chain", p.split(":", 1)[0], "node:" + "|".join(parts[: i + 1])) for i, p in enumerate(parts)]
        if not out or out[-1][1] != source.node:  # a subgraph's node: its own run inside the outer node
            inner = source.parent_run_id or source.run_id or source.node
            out.append(("chain", source.node, f"node:{source.checkpoint_ns}|{source.node}:{inner}"))
        return out
    if source.agent_path:
        return [
            ("agent", name, "agent:" + ">".join(source.agent_path[: i + 1]))
            for i, name in enumerate(source.agent_path)
        ]
    return []


def containers_of(children: list[Obs]) -> list[Obs]:
    """The node / agent observations the generations nest under (their parents set), spanning their children."""
    found: dict[str, Obs] = {}
    for obs in children:
        if obs.call is None:
            continue
        parent: str | None = None
        for kind, name, key in container_path(obs.call):
            box = found.get(key)
            if box is None:
                box = found[key] = Obs(
                    kind=kind, name=name, start_ns=obs.start_ns, end_ns=obs.end_ns, key=key
                )
                box.parent = parent
                box.metadata = {"framework": obs.call.source.framework, "calls": 0}
            box.start_ns, box.end_ns = min(box.start_ns, obs.start_ns), max(box.end_ns, obs.end_ns)
            box.metadata["calls"] += 1
            parent = key
        obs.parent = parent
    for box in found.values():
        box.metadata["calls_below"] = box.metadata.pop("calls")
    return list(found.values())


def tool_obs(messages: list[Message], calls: list[LLMCall], start: float, end: float) -> list[Obs]:
    """One tool observation per assistant tool call, with its result matched by tool_call_id.

    Times: from the end of the LLM call that emitted the tool call to the start of the first call that saw the
    result (the tool ran in between); the trajectory's bounds where no call shows it.
    """
    results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    emitted: dict[str, float] = {}
    emitter: dict[str, LLMCall] = {}
    consumed: dict[str, float] = {}
    for call in calls:
        answer = call.response_message() or {}
        for tc in answer.get("tool_calls") or []:
            emitted.setdefault(tc.get("id"), call.ended_at)
            emitter.setdefault(tc.get("id"), call)
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
                    call=emitter.get(call_id),
                )
            )
    return out


def scores_of(trajectory: Trajectory) -> list[tuple[str, float, str]]:
    """(name, value, data type): the reward (unless missing: no score is written for a placeholder) and each
    finite metric."""
    scores: list[tuple[str, float, str]] = []
    if math.isfinite(trajectory.reward) and not reward_missing(trajectory):
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
    training_data: bool = True,
) -> TracePlan:
    """`training_data`: each generation carries its call's training record, the root the trajectory's."""
    messages = trajectory.messages()
    calls = list(trajectory.llm_calls)
    recorded = trajectory_calls(trajectory) if training_data else []
    numbers = {id(c): k for k, c in enumerate(recorded)}
    records = {id(c): pack_call(c, numbers[id(c)]) for c in recorded}
    children = [generation_obs(c, i, step, record=records.pop(id(c), None)) for i, c in enumerate(calls)]
    for h, history in enumerate(trajectory.additional_histories):
        children += [
            generation_obs(c, i, step, history=h, record=records.pop(id(c), None))
            for i, c in enumerate(history.llm_calls)
        ]
    start = min([trajectory.start_time] + [c.started_at for c in calls])
    end = max([trajectory.end_time or trajectory.start_time] + [c.ended_at for c in calls])
    tools = tool_obs(messages, calls, start, end)
    for history in trajectory.additional_histories:
        tools += tool_obs(history.messages(), history.llm_calls, start, end)
    containers = containers_of(children)  # generations nest under their node / agent observation
    boxes = {box.key: box for box in containers}
    for tool in tools:
        path = container_path(tool.call) if tool.call is not None else []
        tool.parent = path[-1][2] if path else None
        tool.call = None  # the call belongs to its generation (dedupe matches generations only)
        box = boxes.get(tool.parent)
        while box is not None:  # the tool ran inside its agent / node: that observation spans it
            box.start_ns, box.end_ns = min(box.start_ns, tool.start_ns), max(box.end_ns, tool.end_ns)
            box = boxes.get(box.parent)
    children = containers + children + tools
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
            **({TRAJECTORY_KEY: pack_trajectory(trajectory, recorded)} if training_data else {}),
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
