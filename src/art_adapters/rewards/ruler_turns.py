"""A per-turn RULER: the judge ranks the group's calls turn index by turn index (or state by state), one request per
turn, and each score becomes that call's reward (`LLMCall.reward`; see `TrainConfig.advantage`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import openai

from ..calls import LLMCall, Message
from ..trajectories import Trajectory, TrajectoryGroup
from .ruler import TrajectoryScore, _unique_scores

if TYPE_CHECKING:
    from ..model import Model

log = logging.getLogger(__name__)

TURN_RUBRIC = """\
- Each attempt ends with ONE step of an agent: its last assistant message (a tool call or an answer). Score that \
last step only; what came before it is context.
- The scores rank the steps against each other: a step that does more for the user's goal than another must get \
a higher score, even when all of them are weak or all of them are strong.
- A step that makes progress (the right tool with the right arguments, a correct answer) beats one that stalls, \
repeats itself, errs or goes off course; a step that repairs an earlier mistake is progress.
- Spread the scores over the range 0 to 1 where the steps differ."""


def _step(call: LLMCall) -> list[Message] | None:
    """What the agent saw at this call and what it did: the request's messages, then its answer."""
    answer = call.response_message()
    if answer is None:
        return None
    return [*call.request_messages(), answer]


def _turns(
    trajectories: Sequence[Trajectory], by: Literal["turn", "state"]
) -> list[list[tuple[LLMCall, list[Message]]]]:
    """The calls to judge together: those at the same turn index (`by="turn"`), or those from the same state (the
    same prompt token ids, `by="state"`; a state only one call reached is not judged: nothing to rank it by)."""
    buckets: dict[Hashable, list[tuple[LLMCall, list[Message]]]] = {}
    for trajectory in trajectories:
        for t, call in enumerate(trajectory.llm_calls):
            step = _step(call)
            if step is None:
                continue
            if by == "turn":
                key: Hashable = t
            elif call.prompt_token_ids:
                key = tuple(call.prompt_token_ids)
            else:
                continue
            buckets.setdefault(key, []).append((call, step))
    if by == "state":
        return [b for b in buckets.values() if len(b) > 1]
    return list(buckets.values())


def _shared_tools(calls: Sequence[LLMCall]) -> list[dict[str, Any]] | None:
    tools = [c.request_tools() for c in calls]
    return tools[0] if tools and all(t == tools[0] for t in tools) else None


async def ruler_score_turns(
    group: TrajectoryGroup,
    judge_model: str | Model = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = None,
    *,
    by: Literal["turn", "state"] = "turn",
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
    """Score each call of the group against the group's other calls at the same turn index (`by="turn"`: call t
    of every trajectory that made one), or from the same state (`by="state"`: identical prompt token ids); one
    judge request per turn (per state), run concurrently, identical steps judged once. Returns a NEW group whose
    calls carry the scores as `LLMCall.reward` (the input group is left untouched; trajectory rewards unchanged);
    train on them with `TrainConfig(advantage="turn")` or `"gigpo"`. A failed call (no answer) is not judged.

    The judge, its options, retries and errors are RULER's (`ruler_score_group`): a judge that gives no usable
    answer raises RulerError, or with `swallow_exceptions=True` a warning is logged and None returned (the group
    dropped, as `gather_trajectory_groups(after_each=...)` expects). `rubric` replaces the per-step rubric
    (`TURN_RUBRIC`). Each judged call's reason is in its trajectory's `logs`; `metrics["ruler_turn_scores"]`
    counts its judged calls."""
    if by not in ("turn", "state"):
        raise ValueError(f"ruler_score_turns judges by 'turn' or 'state', not {by!r}")
    trajectories = [t.model_copy(deep=True) for t in group.trajectories]
    new = TrajectoryGroup(
        trajectories,
        exceptions=list(group.exceptions),
        metadata=dict(group.metadata),
        metrics=dict(group.metrics),
        logs=list(group.logs),
    )
    buckets = _turns(trajectories, by)
    if not buckets:
        return new
    options: dict[str, Any] = {
        "client": client,
        "extra_litellm_params": extra_litellm_params,
        "rubric": rubric or TURN_RUBRIC,
        "max_retries": max_retries,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "extra_body": extra_body,
        "max_explanation_chars": max_explanation_chars,
        "ordered_ids": ordered_ids,
        "retry_delay": retry_delay,
    }

    async def judged(bucket: list[tuple[LLMCall, list[Message]]]) -> list[TrajectoryScore]:
        calls = [call for call, _ in bucket]
        return await _unique_scores(
            [step for _, step in bucket], judge_model, debug, tools=_shared_tools(calls), **options
        )

    try:
        verdicts = await asyncio.gather(*(judged(bucket) for bucket in buckets))
    except Exception as error:
        if not swallow_exceptions:
            raise
        log.warning("RULER (per turn) dropped a group of %d trajectories: %s", len(trajectories), error)
        return None
    name = judge_model if isinstance(judge_model, str) else judge_model.get_inference_name()
    owner = {id(call): t for t in trajectories for call in t.llm_calls}
    for bucket, scores in zip(buckets, verdicts, strict=True):
        for (call, _), verdict in zip(bucket, scores, strict=True):
            call.reward = verdict.score
            trajectory = owner[id(call)]
            index = next(i for i, c in enumerate(trajectory.llm_calls) if c is call)
            trajectory.metrics["ruler_turn_scores"] = int(trajectory.metrics.get("ruler_turn_scores", 0)) + 1
            trajectory.log(f"RULER turn {index} ({name}, score {verdict.score:.3f}): {verdict.explanation}")
    return new
