"""RULER: an LLM judge scores a group of trajectories relative to each other, in one request, as their rewards."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import openai
from pydantic import BaseModel, Field

from ..trajectories import Message, Trajectory, TrajectoryGroup
from .helpers import common_prefix_length, extract_json, render_messages
from .judge import resolve_judge

if TYPE_CHECKING:
    from ..model import Model

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
- The scores rank the attempts against each other. An attempt that did better than another must get a \
higher score, even when all of them are weak or all of them are strong.
- What matters most is whether the attempt achieved what the user wanted. Finishing the task beats any \
amount of polish on an unfinished one; partial progress earns partial credit.
- Between attempts that reach the goal equally well, prefer the more efficient one: fewer wasted steps, \
repeated tool calls, errors or detours.
- Spread the scores over the range 0 to 1 where the attempts differ."""

_SYSTEM = """\
You judge several attempts by an AI agent at the same task and give each a score from 0 to 1.

Scoring rules:
{rubric}

Reply with JSON only, in this form: \
{{"scores": [{{"trajectory_id": "<id>", "explanation": "<a sentence on why>", "score": <number 0..1>}}]}} \
with exactly one entry per trajectory, in the order they are given."""

_NO_SCHEMA: set[tuple[str, str]] = set()  # (base_url, model) endpoints that rejected response_format


class RulerError(RuntimeError):
    """The judge gave no usable answer (after the allowed retries) or rejected the request."""


class TrajectoryScore(BaseModel):
    """The judge's verdict on one trajectory of the group."""

    trajectory_id: str = Field(description="The trajectory's id in the judge prompt ('1', '2', ...).")
    explanation: str = Field("", description="A short reason for the score.")
    score: float = Field(ge=0.0, le=1.0)


class _BadAnswer(ValueError):
    pass


def response_schema(
    ids: Sequence[str], *, max_explanation_chars: int | None = None, ordered_ids: bool = False
) -> dict[str, Any]:
    """The JSON schema of the judge's answer, with exactly one entry per id (so guided decoding terminates).

    `ordered_ids` pins entry k to id k (JSON Schema `prefixItems`, which vLLM's guided decoding honours but not
    every hosted strict mode accepts), so that even a weak judge cannot repeat or skip an id.
    """
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars is not None:
        explanation["maxLength"] = max_explanation_chars

    def item(trajectory_id: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "trajectory_id": trajectory_id,
                "explanation": explanation,
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }

    scores: dict[str, Any] = {"type": "array", "minItems": len(ids), "maxItems": len(ids)}
    if ordered_ids:
        scores["prefixItems"] = [item({"type": "string", "const": i}) for i in ids]
        scores["items"] = False
    else:
        scores["items"] = item({"type": "string", "enum": list(ids)})
    return {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }


def judge_messages(
    conversations: Sequence[Sequence[Message]],
    rubric: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[Message]:
    """The judge's prompt: the shared prefix once, then each conversation's remainder labelled by its id (never
    empty: an attempt's last message is always its own, even when one attempt is judged alone)."""
    n = common_prefix_length(conversations)
    n = min(n, max(min((len(c) for c in conversations), default=0) - 1, 0))
    parts: list[str] = []
    if tools:
        parts.append(f"Tools available to the agent:\n<tools>\n{render_messages(tools)}\n</tools>")
    if n:
        parts.append(
            f"All attempts begin with these messages:\n<context>\n{render_messages(conversations[0][:n])}\n</context>"
        )
    parts.append("The attempts, continuing from there:" if n else "The attempts:")
    for i, conversation in enumerate(conversations, start=1):
        rest = render_messages(conversation[n:]) or "(no further messages)"
        parts.append(f'<trajectory id="{i}">\n{rest}\n</trajectory>')
    ids = ", ".join(str(i) for i in range(1, len(conversations) + 1))
    parts.append(f"Score each of the {len(conversations)} trajectories (ids {ids}).")
    return [
        {"role": "system", "content": _SYSTEM.format(rubric=(rubric or DEFAULT_RUBRIC).strip())},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def parse_scores(content: str | None, ids: Sequence[str]) -> list[TrajectoryScore]:
    """Validate a judge answer: one numeric score in [0, 1] per id, no unknown or repeated ids; in `ids` order."""
    if content is None or not content.strip():
        raise _BadAnswer("empty answer")
    try:
        data = extract_json(content)
    except ValueError:
        raise _BadAnswer(f"answer is not JSON: {content[:200]!r}") from None
    entries = data.get("scores") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise _BadAnswer("answer has no 'scores' list")
    if len(entries) != len(ids):
        raise _BadAnswer(f"expected {len(ids)} scores, got {len(entries)}")
    by_id: dict[str, TrajectoryScore] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise _BadAnswer(f"score entry is not an object: {entry!r}")
        raw_id = entry.get("trajectory_id")
        tid = str(raw_id).strip() if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else None
        if tid not in ids:
            raise _BadAnswer(f"unknown trajectory id {raw_id!r} (expected one of {', '.join(ids)})")
        if tid in by_id:
            raise _BadAnswer(f"trajectory id {tid!r} scored twice")
        score = entry.get("score")
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise _BadAnswer(f"score of trajectory {tid!r} is not a number: {score!r}")
        if not 0.0 <= score <= 1.0:
            raise _BadAnswer(f"score of trajectory {tid!r} is out of range [0, 1]: {score!r}")
        explanation = entry.get("explanation")
        by_id[tid] = TrajectoryScore(
            trajectory_id=tid,
            score=float(score),
            explanation=explanation if isinstance(explanation, str) else "",
        )
    return [by_id[tid] for tid in ids]


_RETRYABLE = (
    openai.APIConnectionError,
    openai.InternalServerError,
    openai.RateLimitError,
    openai.ConflictError,
)


async def judge_scores(
    conversations: Sequence[Sequence[Message]],
    judge_model: str | Model,
    *,
    client: openai.AsyncOpenAI | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    max_retries: int = 3,
    temperature: float | None = 0.0,
    max_tokens: int | None = None,
    extra_body: dict[str, Any] | None = None,
    max_explanation_chars: int | None = None,
    ordered_ids: bool = False,
    retry_delay: float = 0.5,
) -> list[TrajectoryScore]:
    """Ask the judge once about all conversations; retry bad answers and transient errors, else RulerError."""
    try:
        judge = resolve_judge(judge_model, client, extra_litellm_params)
    except RuntimeError as error:
        raise RulerError(str(error)) from error
    model = judge.name
    ids = [str(i) for i in range(1, len(conversations) + 1)]
    base = judge_messages(conversations, rubric, tools)
    endpoint = judge.endpoint
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "ruler_scores",
            "schema": response_schema(
                ids, max_explanation_chars=max_explanation_chars, ordered_ids=ordered_ids
            ),
            "strict": True,
        },
    }
    use_schema = endpoint not in _NO_SCHEMA
    fell_back = False
    messages = base
    failures = 0
    while True:
        kwargs: dict[str, Any] = {"messages": messages}
        if temperature is not None:  # None: the judge's default (some reasoning models accept no other)
            kwargs["temperature"] = temperature
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if extra_body:
            kwargs["extra_body"] = extra_body
        if use_schema:
            kwargs["response_format"] = schema
        try:
            content = await judge.complete(kwargs)
        except openai.BadRequestError as error:
            if use_schema:
                log.info("judge %s rejected response_format (%s); asking without it", model, error)
                use_schema, fell_back = False, True
                continue
            raise RulerError(f"judge {model!r} rejected the request: {error}") from error
        except _RETRYABLE as error:
            problem = f"request failed: {error}"
        except openai.APIError as error:
            raise RulerError(f"judge {model!r} request failed: {error}") from error
        else:
            try:
                scores = parse_scores(content, ids)
            except _BadAnswer as error:
                problem = str(error)
                messages = base
                if content and content.strip():
                    correction = (
                        f"That answer could not be used: {problem}. Reply again with only the JSON object, "
                        f"one entry for each of the ids {', '.join(ids)}."
                    )
                    messages = [
                        *base,
                        {"role": "assistant", "content": content},
                        {"role": "user", "content": correction},
                    ]
            else:
                if fell_back:  # the endpoint answers well without it: stop sending it there
                    _NO_SCHEMA.add(endpoint)
                return scores
        failures += 1
        if failures > max_retries:
            raise RulerError(
                f"judge {model!r} gave no valid answer in {failures} attempt(s); last problem: {problem}"
            )
        log.info("judge %s attempt %d failed (%s); retrying", model, failures, problem)
        if retry_delay > 0:
            await asyncio.sleep(retry_delay * 2 ** (failures - 1))


def _shared_tools(trajectories: Sequence[Trajectory]) -> list[dict[str, Any]] | None:
    tools = [t.tools for t in trajectories]
    return tools[0] if tools and all(t == tools[0] for t in tools) else None


async def _unique_scores(
    conversations: Sequence[Sequence[Message]], judge_model: str | Model, debug: bool, **options: Any
) -> list[TrajectoryScore]:
    """Scores aligned with `conversations` (ids "1".."n" in input order); identical conversations are judged
    once and share their score."""
    keys = [json.dumps(list(c), sort_keys=True, default=str) for c in conversations]
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    unique = list(first.values())
    verdicts = await judge_scores([conversations[i] for i in unique], judge_model, **options)
    by_key = {keys[i]: verdict for i, verdict in zip(unique, verdicts, strict=True)}
    scores = [by_key[key].model_copy(update={"trajectory_id": str(i)}) for i, key in enumerate(keys, start=1)]
    if debug:
        name = judge_model if isinstance(judge_model, str) else judge_model.get_inference_name()
        print(f"RULER judge {name}:")
        for verdict in scores:
            print(f"  [{verdict.trajectory_id}] {verdict.score:.3f}  {verdict.explanation}")
    return scores


def _apply(trajectories: Sequence[Trajectory], scores: Sequence[TrajectoryScore], judge: str) -> None:
    for trajectory, verdict in zip(trajectories, scores, strict=True):
        if "ruler_score" not in trajectory.metrics:  # a second judging keeps the original reward
            trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.metrics["ruler_score"] = verdict.score
        trajectory.reward = verdict.score
        trajectory.metadata["ruler_explanation"] = verdict.explanation
        trajectory.metadata["ruler_judge"] = judge
        trajectory.log(f"RULER explanation ({judge}, score {verdict.score:.3f}): {verdict.explanation}")


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str | Model = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = None,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    client: openai.AsyncOpenAI | None = None,
    max_retries: int = 3,
    temperature: float | None = 0.0,
    extra_body: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    max_explanation_chars: int | None = None,
    ordered_ids: bool = False,
    retry_delay: float = 0.5,
) -> TrajectoryGroup | None:
    """Score a group with one judge request; returns a NEW group whose trajectories carry the scores as rewards
    (the input group is left untouched, as in ART). Identical trajectories are judged once and share a score.

    Each new trajectory keeps its previous reward in `metrics["independent_reward"]`, the score in
    `metrics["ruler_score"]`, the judge's reason in `metadata["ruler_explanation"]` and `logs`. On failure,
    raises RulerError, or with `swallow_exceptions=True` logs a warning and returns None (the group is dropped,
    as `after_each` in `gather_trajectory_groups` expects).

    `judge_model`: a LiteLLM-style string (`"openai/o4-mini"`, `"hosted_vllm/Qwen3-32B"`, `"anthropic/..."`;
    see `rewards.judge` for how it is reached, `extra_litellm_params` for `api_base`/`api_key`/...), a model
    name served by `client` (any OpenAI-compatible endpoint), or an art Model (its `openai_client()`).
    `max_retries` counts extra attempts after bad answers and transient errors; a 400 to the JSON schema
    `response_format` makes it ask without one, uncounted. `max_tokens`, `max_explanation_chars` and
    `ordered_ids` bound the answer for small judges under guided decoding. `debug` prints the verdicts.
    """
    trajectories = [t.model_copy(deep=True) for t in group.trajectories]
    new = TrajectoryGroup(
        trajectories,
        exceptions=list(group.exceptions),
        metadata=dict(group.metadata),
        metrics=dict(group.metrics),
        logs=list(group.logs),
    )
    if not trajectories:
        return new
    try:
        scores = await _unique_scores(
            [t.messages() for t in trajectories],
            judge_model,
            debug,
            client=client,
            extra_litellm_params=extra_litellm_params,
            rubric=rubric,
            tools=_shared_tools(trajectories),
            max_retries=max_retries,
            temperature=temperature,
            max_tokens=max_tokens,
            extra_body=extra_body,
            max_explanation_chars=max_explanation_chars,
            ordered_ids=ordered_ids,
            retry_delay=retry_delay,
        )
    except Exception as error:
        if not swallow_exceptions:
            raise
        log.warning("RULER dropped a group of %d trajectories: %s", len(trajectories), error)
        return None
    name = judge_model if isinstance(judge_model, str) else judge_model.get_inference_name()
    _apply(trajectories, scores, name)
    return new


async def ruler(
    message_lists: Sequence[Sequence[Message] | Trajectory],
    judge_model: str | Model = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    *,
    debug: bool = False,
    client: openai.AsyncOpenAI | None = None,
    **options: Any,
) -> list[TrajectoryScore]:
    """Score conversations (message lists, or Trajectories) against each other; one `TrajectoryScore`
    (`trajectory_id` "1".."n" in input order, `score`, `explanation`) per input. Nothing is modified."""
    conversations = [m.messages() if isinstance(m, Trajectory) else list(m) for m in message_lists]
    if not conversations:
        return []
    return await _unique_scores(
        conversations,
        judge_model,
        debug,
        client=client,
        extra_litellm_params=extra_litellm_params,
        rubric=rubric,
        tools=tools,
        **options,
    )
