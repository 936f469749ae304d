"""OpenTelemetry GenAI spans (`gen_ai.*` semantic conventions) as Trajectories: one per trace, one chat call per
inference span, no sampled token ids (flagged `metadata["sampled_token_ids"] = False`).

Reads the current conventions (`gen_ai.input.messages` / `gen_ai.output.messages` / `gen_ai.system_instructions`
/ `gen_ai.tool.definitions`, on the span or on a `gen_ai.client.inference.operation.details` event), the older
per-message events (`gen_ai.user.message`, `gen_ai.choice`, ...) and OpenLLMetry's indexed `gen_ai.prompt.N.*` /
`gen_ai.completion.N.*` attributes.

    trajectories = read_otlp(["traces.json"], reward="app.reward")
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..redaction import Redactor, apply, drop_secrets
from ..trajectories import REWARD_MISSING, LLMCall, Message, Trajectory, check_missing_reward
from ._foreign import (
    Rewarder,
    RewardFn,
    answer_message,
    chat_message,
    foreign_call,
    foreign_trajectory,
    parsed,
)
from .otlp import Span, read_files

log = logging.getLogger(__name__)
INFERENCE_OPERATIONS = {"chat", "text_completion", "generate_content"}
_EVENT_ROLES = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
_PARAMETERS = {
    "gen_ai.request.temperature": "temperature",
    "gen_ai.request.top_p": "top_p",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.seed": "seed",
}


def is_inference(span: Span) -> bool:
    a = span["attributes"]
    operation = a.get("gen_ai.operation.name")
    if operation is not None:
        return operation in INFERENCE_OPERATIONS
    return any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.", "gen_ai.input.messages")) for k in a)


def call_of(span: Span) -> LLMCall:
    """One inference span as a chat call (messages in, the answer out, no token ids)."""
    a = span["attributes"]
    details = next(
        (e["attributes"] for e in span["events"] if e["name"] == "gen_ai.client.inference.operation.details"),
        {},
    )
    merged = {**details, **a}
    messages = _input_messages(merged, span["events"])
    answer = _output_message(merged, span["events"])
    reasons = merged.get("gen_ai.response.finish_reasons")
    tools = parsed(merged.get("gen_ai.tool.definitions"))
    return foreign_call(
        messages,
        answer,
        model=merged.get("gen_ai.request.model") or merged.get("gen_ai.response.model"),
        started_at=span["start_ns"] / 1e9,
        ended_at=span["end_ns"] / 1e9,
        parameters={v: merged[k] for k, v in _PARAMETERS.items() if k in merged},
        usage={
            "input": merged.get("gen_ai.usage.input_tokens", merged.get("gen_ai.usage.prompt_tokens")),
            "output": merged.get("gen_ai.usage.output_tokens", merged.get("gen_ai.usage.completion_tokens")),
        },
        tools=[_tool(t) for t in tools] if isinstance(tools, list) else None,
        finish_reason=reasons[0] if isinstance(reasons, list) and reasons else None,
        error=merged.get("error.type") if span.get("status") in (2, "STATUS_CODE_ERROR") else None,
    )


def _input_messages(a: dict[str, Any], events: list[dict[str, Any]]) -> list[Message]:
    out: list[Message] = []
    system = parsed(a.get("gen_ai.system_instructions"))
    if isinstance(system, list):
        text = "".join(
            p.get("content", "") for p in system if isinstance(p, dict) and p.get("type") == "text"
        )
        out.append({"role": "system", "content": text})
    elif isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    current = parsed(a.get("gen_ai.input.messages"))
    if isinstance(current, list):
        return out + [m for m in (chat_message(x, "user") for x in current) if m is not None]
    for event in events:  # the per-message events (conventions up to 1.36)
        role = _EVENT_ROLES.get(event["name"])
        if role is not None:
            body = event["attributes"]
            message = chat_message({**body, "role": body.get("role", role), "content": _content(body)}, role)
            if message is not None:
                out.append(message)
    return out + _indexed(a, "gen_ai.prompt")


def _output_message(a: dict[str, Any], events: list[dict[str, Any]]) -> Message | None:
    current = parsed(a.get("gen_ai.output.messages"))
    if isinstance(current, list) and current:
        return chat_message(current[0], "assistant")
    for event in events:
        if event["name"] == "gen_ai.choice":
            body = event["attributes"]
            message = parsed(body.get("message")) or {"role": "assistant", "content": _content(body)}
            return answer_message(message)
    completions = _indexed(a, "gen_ai.completion")
    return completions[0] if completions else None


def _content(body: dict[str, Any]) -> Any:
    content = body.get("content", body.get("gen_ai.event.content", ""))
    return parsed(content) if isinstance(content, str) and content[:1] in "[{" else content


def _indexed(a: dict[str, Any], prefix: str) -> list[Message]:
    """OpenLLMetry's `gen_ai.prompt.0.role` / `.content` (and `.tool_calls.K.*`) as messages."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in a.items():
        if key.startswith(prefix + "."):
            index, _, field = key[len(prefix) + 1 :].partition(".")
            if index.isdigit():
                found.setdefault(int(index), {})[field] = value
    out = []
    for _, fields in sorted(found.items()):
        calls: dict[int, dict[str, Any]] = {}
        for field, value in fields.items():
            if field.startswith("tool_calls."):
                k, _, name = field[len("tool_calls.") :].partition(".")
                if k.isdigit():
                    calls.setdefault(int(k), {})[name] = value
        message = chat_message({"role": fields.get("role", "user"), "content": fields.get("content", "")})
        if message is not None:
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.get("id", ""),
                        "type": "function",
                        "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "{}")},
                    }
                    for _, c in sorted(calls.items())
                ]
            out.append(message)
    return out


def _tool(definition: Any) -> dict[str, Any]:
    if isinstance(definition, dict) and "function" not in definition and "name" in definition:
        return {"type": "function", "function": {k: v for k, v in definition.items() if k != "type"}}
    return definition


def trajectories_from_spans(
    spans: Iterable[Span],
    *,
    reward: str | RewardFn | None = None,
    missing_reward: float | None = None,
    redact: Redactor | None = drop_secrets,
    stats: dict[str, int] | None = None,
) -> list[Trajectory]:
    """One Trajectory per trace holding inference spans. The reward: the numeric or boolean span attribute named
    `reward` (any span of the trace), or `reward(attributes)` over all of them. In a trace of several inference
    spans, the attribute named `reward` on a chat span is that call's reward (`LLMCall.reward`, a turn's: see
    `TrainConfig.advantage`) and the trajectory's comes from the other spans (0.0 when only calls carry one);
    a trace without a finite one gets
    `missing_reward`, or (None) is flagged `metadata["reward_missing"] = True` with a 0.0 placeholder, which every
    grouping and the trainer skip and count (`art_adapters.trajectories.reward_missing`). A trace whose calls carry
    no message at all (content capture off, or its log events never came) is skipped; `stats` counts
    `no_messages` and `no_reward` (flagged) when given."""
    check_missing_reward(missing_reward)
    traces: dict[str, list[Span]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    rewarder = Rewarder(reward)
    counts = stats if stats is not None else {}
    out: list[Trajectory] = []
    for trace_id, members in traces.items():
        inference = sorted((s for s in members if is_inference(s)), key=lambda s: s["start_ns"])
        if not inference:
            continue
        calls = [call_of(s) for s in inference]
        if not any(_carries_messages(c) for c in calls):
            counts["no_messages"] = counts.get("no_messages", 0) + 1
            continue
        root = next((s for s in members if s["parent_span_id"] is None), inference[0])
        if len(inference) > 1 and isinstance(reward, str):  # a turn's reward on its chat span is that call's
            for call, chat_span in zip(calls, inference, strict=True):
                call.reward = rewarder(_numbers([chat_span]))
            numbers = _numbers([s for s in members if not is_inference(s)])
        else:
            numbers = _numbers(members)
        trajectory = foreign_trajectory(
            calls,
            source="otel_genai",
            trace_id=trace_id,
            metadata={
                "trace_name": root["name"],
                "service": root["resource"].get("service.name"),
                "conversation_id": next(
                    (
                        s["attributes"]["gen_ai.conversation.id"]
                        for s in members
                        if "gen_ai.conversation.id" in s["attributes"]
                    ),
                    None,
                ),
            },
        )
        value = rewarder(numbers)
        if value is not None and not math.isfinite(value):  # NaN or infinity is no reward
            value = None
        if value is None and any(c.reward is not None for c in trajectory.llm_calls):
            value = 0.0  # its calls carry the rewards: not missing
        if value is None:
            value = missing_reward
        trajectory.reward = float(value) if value is not None else 0.0
        if value is None:  # after the placeholder: assigning a reward clears the flag
            trajectory.metadata[REWARD_MISSING] = True
            counts["no_reward"] = counts.get("no_reward", 0) + 1
        kept = apply(redact, trajectory)
        if kept is not None:
            out.append(kept)
    if stats is None and counts.get("no_messages"):  # a caller that counts says it itself
        log.warning("%d trace(s) skipped: %s", counts["no_messages"], NO_MESSAGES)
    return out


NO_MESSAGES = (
    "their calls carry no message (turn on the instrumentation's content capture; the official OpenAI one "
    "writes messages to log events: export its logs to the endpoint's /v1/logs as well)"
)


def _carries_messages(call: LLMCall) -> bool:
    """Whether a call holds any message with content or tool calls (in its request or its answer)."""
    messages = list(call.request.get("messages") or [])
    for choice in (call.response or {}).get("choices") or []:
        messages.append(choice.get("message") or {})
    return any(isinstance(m, dict) and (m.get("content") or m.get("tool_calls")) for m in messages)


def _numbers(spans: list[Span]) -> dict[str, float]:
    """The spans' numeric and boolean attributes as numbers (the latest span's winning); a NaN or infinite value
    (OTLP/JSON writes them as "NaN", "Infinity") or an integer past a float's range is not a number."""
    out: dict[str, float] = {}
    for span in sorted(spans, key=lambda s: s["end_ns"]):
        for key, value in span["attributes"].items():
            if isinstance(value, bool):
                out[key] = 1.0 if value else 0.0
            elif isinstance(value, int | float) and not key.startswith("gen_ai."):
                try:
                    number = float(value)
                except OverflowError:
                    continue
                if math.isfinite(number):
                    out[key] = number
    return out


def read_otlp(
    paths: str | Path | Iterable[str | Path],
    *,
    reward: str | RewardFn | None = None,
    missing_reward: float | None = None,
    redact: Redactor | None = drop_secrets,
    stats: dict[str, int] | None = None,
) -> list[Trajectory]:
    """Trajectories of OTLP/JSON trace files (an export request per file, or per line); see
    `trajectories_from_spans` for the reward, `missing_reward` and `stats`."""
    check_missing_reward(missing_reward)
    files = [paths] if isinstance(paths, str | Path) else list(paths)
    return trajectories_from_spans(
        read_files(files), reward=reward, missing_reward=missing_reward, redact=redact, stats=stats
    )
