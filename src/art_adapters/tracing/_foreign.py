"""Traces we did not write (Langfuse's OpenAI wrapper and LangChain handler, OpenTelemetry GenAI spans) as
Trajectories: chat calls rebuilt from the recorded messages, with no sampled token ids (flagged so), and scores
turned into rewards."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..calls import LLMCall, Message
from ..trajectories import Trajectory

log = logging.getLogger(__name__)
ScoreValue = float | bool | str
RewardFn = Callable[[dict[str, float]], "float | None"]
_LANGCHAIN_ROLES = {
    "human": "user",
    "ai": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}


# ---- messages in the shapes tracers write ---------------------------------------------------------------------


def parsed(value: Any) -> Any:
    """Input/output as Langfuse returns them (raw JSON strings), parsed; other strings stay text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def chat_message(value: Any, default_role: str = "assistant") -> Message | None:
    """One message in OpenAI chat form, from OpenAI's, LangChain's or GenAI semantic conventions' shape."""
    if isinstance(value, str):
        return {"role": default_role, "content": value}
    if not isinstance(value, dict):
        return None
    if "parts" in value:  # gen_ai.input.messages / gen_ai.output.messages
        return _from_parts(value)
    if "message" in value and isinstance(value["message"], dict):  # a choice
        return chat_message(value["message"], default_role)
    kwargs = value.get("kwargs") if isinstance(value.get("kwargs"), dict) else None
    if kwargs is not None and "content" in kwargs:  # a serialized LangChain message
        value = {**kwargs, "type": (value.get("id") or ["", "ai"])[-1].replace("Message", "").lower()}
    role = value.get("role") or _LANGCHAIN_ROLES.get(str(value.get("type", "")).lower()) or default_role
    message: Message = {"role": role, "content": _text(value.get("content"))}
    extra = value.get("additional_kwargs")
    calls = value.get("tool_calls") or (extra.get("tool_calls") if isinstance(extra, dict) else None)
    if isinstance(calls, list):  # anything else (a string, a number) is no tool call
        calls = [_tool_call(c) for c in calls if isinstance(c, dict)]
        if calls:
            message["tool_calls"] = calls
    if role == "tool" and value.get("tool_call_id"):
        message["tool_call_id"] = value["tool_call_id"]
    if value.get("name") and role != "assistant":
        message["name"] = value["name"]
    return message


def chat_messages(value: Any) -> list[Message] | None:
    """A request's messages from a tracer's input: a list of messages, or an object holding `messages`."""
    value = parsed(value)
    if isinstance(value, dict) and isinstance(value.get("messages"), list):
        value = value["messages"]
    if (
        isinstance(value, list) and value and isinstance(value[0], list)
    ):  # LangChain batches: one list per prompt
        value = value[0]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return None
    out = [chat_message(m, "user") for m in value]
    return [m for m in out if m is not None] or None


def answer_message(value: Any) -> Message | None:
    value = parsed(value)
    if isinstance(value, dict) and isinstance(value.get("choices"), list) and value["choices"]:
        value = value["choices"][0]
    if isinstance(value, dict) and isinstance(value.get("generations"), list):  # LangChain LLMResult
        first = value["generations"][0] if value["generations"] else None
        value = first[0] if isinstance(first, list) and first else first
    if isinstance(value, list):
        value = value[0] if value else None
    return chat_message(value, "assistant")


def _text(content: Any) -> Any:
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(texts) if texts else content
    return "" if content is None else content


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    if "function" in call:
        return call
    arguments = call.get("args", call.get("arguments", {}))
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {
            "name": str(call.get("name") or ""),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def _from_parts(message: dict[str, Any]) -> Message | None:
    """A GenAI semantic-conventions message (`{"role", "parts": [...]}`) in chat form."""
    role = message.get("role") or "assistant"
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    out: Message = {"role": role}
    parts = message.get("parts")
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("content", "")))
        elif kind == "tool_call":
            calls.append(
                _tool_call({"id": part.get("id"), "name": part.get("name"), "args": part.get("arguments")})
            )
        elif kind == "tool_call_response":
            out = {"role": "tool", "tool_call_id": part.get("id") or ""}
            response = part.get("response")
            texts.append(response if isinstance(response, str) else json.dumps(response))
    out["content"] = "".join(texts)
    if calls:
        out["tool_calls"] = calls
    return out


# ---- calls and trajectories -----------------------------------------------------------------------------------


def foreign_call(
    messages: list[Message],
    answer: Message | None,
    *,
    model: str | None,
    started_at: float,
    ended_at: float,
    parameters: Mapping[str, Any] | None = None,
    usage: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    error: str | None = None,
) -> LLMCall:
    """A chat call as a tracer saw it: messages in, the answer out, no token ids."""
    request: dict[str, Any] = {"model": model or "", "messages": messages}
    for key, value in (parameters or {}).items():
        if isinstance(value, str | int | float | bool) and key not in request:
            request[key] = parsed(value) if isinstance(value, str) and value[:1] in "[{" else value
    if tools:
        request["tools"] = tools
    response = None
    if answer is not None:
        reason = finish_reason or ("tool_calls" if answer.get("tool_calls") else "stop")
        response = {"model": model, "choices": [{"index": 0, "message": answer, "finish_reason": reason}]}
        if isinstance(usage, Mapping) and usage:
            response["usage"] = {
                "prompt_tokens": usage.get("input", usage.get("prompt_tokens")),
                "completion_tokens": usage.get("output", usage.get("completion_tokens")),
            }
    return LLMCall(
        request=request,
        response=response,
        url="/v1/chat/completions",
        status_code=200 if error is None else None,
        started_at=started_at,
        latency_s=max(ended_at - started_at, 0.0),
        error=error,
    )


def foreign_trajectory(
    calls: list[LLMCall], *, source: str, trace_id: str, metadata: Mapping[str, Any] | None = None
) -> Trajectory:
    """Calls chained into conversations, as captured calls are; flagged: no sampled token ids (they train only as
    re-rendered text, `TrainConfig(train_retokenized_text=True)` or SFT)."""
    calls = sorted(calls, key=lambda c: c.started_at)
    start = min((c.started_at for c in calls), default=0.0)
    end = max((c.ended_at for c in calls), default=start)
    meta = {k: v for k, v in (metadata or {}).items() if isinstance(v, str | int | float | bool) or v is None}
    trajectory = Trajectory(
        llm_calls=calls,
        start_time=start,
        end_time=end,
        metadata={**meta, "trace_id": trace_id, "trace_source": source, "sampled_token_ids": False},
    )
    return trajectory.finish()


# ---- scores -> rewards -----------------------------------------------------------------------------------------


class Rewarder:
    """Scores become numbers (numeric as is, boolean 1/0, categorical through `categories[name][value]`), then a
    reward: the score named `reward`, or `reward(scores)` for a function combining several."""

    def __init__(
        self,
        reward: str | RewardFn | None = "reward",
        categories: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        self.reward = reward
        self.categories = {k: dict(v) for k, v in (categories or {}).items()}
        self.unmapped: set[str] = set()  # reward scores warned about an unmapped category (once each)

    def numbers(self, scores: list[tuple[str, ScoreValue, str]]) -> dict[str, float]:
        """name -> number, the latest score of each name winning (scores come oldest first)."""
        out: dict[str, float] = {}
        for name, value, data_type in scores:
            number = self.number(name, value, data_type)
            if number is not None:
                out[name] = number
        return out

    def number(self, name: str, value: ScoreValue, data_type: str | None) -> float | None:
        """The score as a finite number, or None: a category the mapping lacks, a value that is no number, NaN or
        infinity (for the reward score that is: no reward)."""
        kind = str(data_type or "").upper()
        if kind == "BOOLEAN" or isinstance(value, bool):
            return 1.0 if value in (True, 1, 1.0, "true", "True") else 0.0
        if kind == "CATEGORICAL" or isinstance(value, str):
            mapping = self.categories.get(name)
            if mapping is None:
                return None  # not a number unless the user maps it
            if str(value) not in mapping:
                if name == self.reward and name not in self.unmapped:
                    self.unmapped.add(name)
                    log.warning(
                        "score %r has category %r, which categories[%r] does not map (it maps %s): "
                        "such traces have no reward",
                        name,
                        value,
                        name,
                        sorted(mapping),
                    )
                return None
            return _finite(mapping[str(value)])
        return _finite(value)

    def __call__(self, numbers: dict[str, float]) -> float | None:
        """The reward, or None (no reward): also when the function's answer is NaN, infinite or no number."""
        if self.reward is None:
            return None
        if callable(self.reward):
            return _finite(self.reward(dict(numbers)))
        return numbers.get(self.reward)


def _finite(value: Any) -> float | None:
    """A finite float, or None (None, NaN, infinities, a value float() refuses or overflows on)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None
