"""Where a trajectory's samples come from: captured calls, hand-built Choices, and (on request) re-rendered text.

A `Sample` is one sampled completion with the exact prompt it was sampled from.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from ..capture.sampling import unreproducible_settings
from ..conversations import message_key
from ..sources import CallSource
from ..trajectories import History, LLMCall, Tools, Trajectory, messages_of
from .render import ChatTokenizer, chat_template_ids
from .versions import span_versions

log = logging.getLogger(__name__)

NAN = float("nan")


@dataclass
class Sample:
    """One sampled completion and the exact prompt it was sampled from. `excluded`: why its logprobs are not of a
    distribution the trainer reproduces (they are dropped: NaN, no importance ratio), or None. `origin`: where its
    ids come from: a call our transport recorded from the engine's answer ("captured"), a Choice the rollout
    supplied ("choice"), or re-rendered text ("text", only with `train_retokenized_text`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    temperature: float
    excluded: str | None = None
    source: CallSource | None = None
    trained: bool = True  # False: chained as context only (its call is not among `train_on`)
    origin: Literal["captured", "choice", "text"] = "captured"
    policy_version: int | None = None  # the training step whose weights sampled it (None: not known)
    token_versions: list[int | None] | None = None  # per completion token, from ART's policy_token_spans
    prompt_exact: bool = True  # the prompt ids are the engine's (False: rendered here by the chat template)
    call: int | None = None  # its call's index in `trajectory.llm_calls` (None: a Choice or text, no call)

    def versions(self) -> list[int | None]:
        """The policy version that sampled each completion token (ART's spans where given, else the call's)."""
        return self.token_versions or [self.policy_version] * len(self.completion_ids)

    @property
    def sampled(self) -> bool:
        """Whether the ids were sampled by an engine (False only for re-tokenized text)."""
        return self.origin != "text"


def samples_of(
    trajectory: Trajectory,
    tokenizer: ChatTokenizer,
    *,
    train_unkept_choices: bool = False,
    train_retokenized_text: bool = False,
) -> list[Sample]:
    """Every sampled completion of the trajectory, in order: captured calls first, then hand-built Choices
    (then, only with `train_retokenized_text`, assistant turns without sampled ids, re-rendered: `sampled=False`).

    A Choice whose sampled ids equal a captured call's is the same sample (the conversation view of the call)
    and is not counted twice. Unkept choices of n > 1 calls are left out (see `tokenize_trajectory`).
    """
    histories: list[History | Trajectory] = [trajectory, *trajectory.additional_histories]
    per_call: list[list[Sample]] = []
    calls_seen: set[tuple[Any, ...]] = set()
    # a history may list the trajectory's calls too (`finish()`); a sample keeps its call's index in the trajectory
    for h, history in enumerate(histories):
        for c, call in enumerate(history.llm_calls):
            key = (
                call.started_at,
                tuple(call.prompt_token_ids or ()),
                tuple(call.completion_token_ids or ()),
            )
            if key not in calls_seen:
                calls_seen.add(key)
                per_call.append(_samples_of_call(call, c if h == 0 else None))
    if not train_unkept_choices:
        per_call = _kept_choices(per_call, _choice_ids(histories))
    samples = [s for call in per_call for s in call]
    seen = Counter(tuple(s.completion_ids) for s in samples)
    for history in histories:
        samples += _samples_of_choices(history.messages_and_choices, history.tools, tokenizer, seen)
    if train_retokenized_text:
        covered = {
            message_key(message)
            for history in histories
            for call in history.llm_calls
            if call.completion_token_ids and (message := call.response_message()) is not None
        }
        for history in histories:
            samples += _retokenized_turns(history, tokenizer, covered)
    return samples


def _retokenized_turns(
    history: History | Trajectory, tokenizer: ChatTokenizer, covered: set[tuple[Any, ...]]
) -> list[Sample]:
    """Assistant turns without sampled ids (plain message dicts, or Choices of a server that gave none, such as
    Anthropic's Messages API), rendered by the chat template; a turn a captured call already answered with
    sampled ids (its message in `covered`) is that call's sample, not trained twice."""
    plain = [
        i
        for i, item in enumerate(history.messages_and_choices)
        if (isinstance(item, dict) and item.get("role") == "assistant" and "token_ids" not in item)
        or (isinstance(item, Choice) and _extra(item, "token_ids") is None)
    ]
    messages = history.messages()
    out = []
    for i in plain:
        if message_key(messages[i]) in covered:
            continue
        turn = rendered_turn(tokenizer, messages, i, history.tools)
        if turn is not None:
            prefix, completion = turn
            out.append(
                Sample(prefix, completion, [NAN] * len(completion), 1.0, origin="text", prompt_exact=False)
            )
    return out


def rendered_turn(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], i: int, tools: Tools | None
) -> tuple[list[int], list[int]] | None:
    """Assistant turn `i` as the template renders it: (prompt ids, the turn's ids up to and including its
    end-of-turn token); the template's tokens after it (Qwen's newline) belong to the next prompt, not to what a
    model would sample. None when the turn does not extend its prompt under the template."""
    prefix = chat_template_ids(tokenizer, messages[:i], tools)
    full = chat_template_ids(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
    if full[: len(prefix)] != prefix or len(full) == len(prefix):
        log.warning("assistant turn %d does not extend its prompt under the chat template; skipped", i)
        return None
    completion = full[len(prefix) :]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos in completion:
        completion = completion[: len(completion) - completion[::-1].index(eos)]
    return prefix, completion


def excluded_reason(request: dict[str, Any], logprobs_mode: str | None) -> str | None:
    """Why logprobs recorded for `request` are not of a distribution the trainer reproduces (it applies only the
    temperature): settings such as top_p or guided decoding, greedy sampling, or logprobs of unknown or raw kind
    at a temperature other than 1. None when they can be used."""
    reasons = unreproducible_settings(request)
    temperature = _temperature(request)
    if temperature < 1e-5:
        reasons.append("temperature 0 (greedy)")
    elif temperature != 1.0 and logprobs_mode != "processed_logprobs":
        reasons.append(f"{logprobs_mode or 'unknown-kind'} logprobs at temperature {temperature:g}")
    return ", ".join(reasons) or None


def _choice_ids(histories: list[History | Trajectory]) -> set[tuple[int, ...]]:
    """Sampled ids of the Choices the rollout appended to its conversations (choices it kept)."""
    out: set[tuple[int, ...]] = set()
    for history in histories:
        for item in history.messages_and_choices:
            ids = _extra(item, "token_ids") if isinstance(item, Choice) else None
            if ids:
                out.add(tuple(ids))
    return out


def _kept_choices(per_call: list[list[Sample]], appended: set[tuple[int, ...]]) -> list[list[Sample]]:
    """Of each call's choices, those a later call continues or the rollout appended; the first if none was."""
    out: list[list[Sample]] = []
    for i, choices in enumerate(per_call):
        if len(choices) <= 1:
            out.append(choices)
            continue
        later = [s.prompt_ids for call in per_call[i + 1 :] for s in call]
        kept = [s for s in choices if _is_kept(s, later, appended)]
        out.append(kept or choices[:1])
    return out


def _is_kept(sample: Sample, later_prompts: list[list[int]], appended: set[tuple[int, ...]]) -> bool:
    whole = sample.prompt_ids + sample.completion_ids
    return tuple(sample.completion_ids) in appended or any(p[: len(whole)] == whole for p in later_prompts)


def _samples_of_call(call: LLMCall, index: int | None = None) -> list[Sample]:
    if call.error or not call.prompt_token_ids:
        return []
    temperature = _temperature(call.request)
    excluded = excluded_reason(call.request, call.logprobs_mode)
    if temperature < 1e-5:  # greedy: no sampling distribution; the trainer's own at T=1 stands in
        temperature = 1.0
    keep_logprobs = excluded is None
    choices = [(call.completion_token_ids, call.logprobs)]
    choices += [(c.token_ids, c.logprobs) for c in call.other_choices]
    samples = []
    for token_ids, logprobs in choices:
        if not token_ids:
            continue
        samples.append(
            Sample(
                prompt_ids=list(call.prompt_token_ids),
                completion_ids=list(token_ids),
                logprobs=_aligned(logprobs if keep_logprobs else None, len(token_ids)),
                temperature=temperature,
                excluded=excluded,
                source=call.source,
                policy_version=call.policy_version,
                call=index,
            )
        )
    return samples


def _samples_of_choices(
    items: list[Any], tools: Tools | None, tokenizer: ChatTokenizer, seen: Counter[tuple[int, ...]]
) -> list[Sample]:
    """Samples of the Choices carrying `token_ids`, except those already `seen` (counted down)."""
    samples = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "message" in item and "token_ids" in item:
            item = Choice.model_validate(item)  # a Choice that came back from JSON as a plain dict
        if not isinstance(item, Choice):
            continue
        token_ids = _extra(item, "token_ids")
        if not token_ids:
            continue
        if seen[tuple(token_ids)] > 0:
            seen[tuple(token_ids)] -= 1
            continue
        prompt_ids = _extra(item, "prompt_token_ids")
        prompt_exact = bool(prompt_ids)
        if not prompt_ids:
            prompt_ids = chat_template_ids(tokenizer, messages_of(items[:i]), tools)
        logprobs = None
        if item.logprobs is not None and item.logprobs.content is not None:
            logprobs = [entry.logprob for entry in item.logprobs.content]
        note = _extra(item, "sampling") or {}  # what the recording client noted of the request (our backend)
        temperature = note.get("temperature", _extra(item, "temperature"))
        temperature = 1.0 if temperature is None else float(temperature)
        excluded = ", ".join(note.get("unreproducible") or []) or None
        if temperature < 1e-5:
            temperature, excluded = 1.0, ", ".join(filter(None, [excluded, "temperature 0 (greedy)"]))
        samples.append(
            Sample(
                prompt_ids=[int(t) for t in prompt_ids],
                completion_ids=[int(t) for t in token_ids],
                logprobs=_aligned(None if excluded else logprobs, len(token_ids)),
                temperature=temperature,
                excluded=excluded,
                origin="choice",
                policy_version=_extra(item, "policy_version"),
                token_versions=span_versions(_extra(item, "policy_token_spans"), len(token_ids)),
                prompt_exact=prompt_exact,
            )
        )
    return samples


def _extra(choice: Choice, key: str) -> Any:
    value = getattr(choice, key, None)
    if value is None and choice.model_extra:
        value = choice.model_extra.get(key)
    return value


def _temperature(request: dict[str, Any]) -> float:
    value = request.get("temperature")
    return 1.0 if value is None else float(value)


def _aligned(logprobs: list[float] | None, n: int) -> list[float]:
    """The sampled logprobs, or NaN (ratio taken as 1) when missing, misaligned or not finite."""
    if logprobs is None or len(logprobs) != n:
        return [NAN] * n
    return [float(x) if x is not None and math.isfinite(x) else NAN for x in logprobs]


def sft_samples(trajectory: Trajectory, tokenizer: ChatTokenizer) -> list[Sample]:
    """Supervised data: each assistant turn as it was sampled where its token ids were recorded (exact, as the
    engine produced them), re-rendered by the chat template otherwise (a turn without ids: plain messages,
    foreign traces)."""
    return samples_of(trajectory, tokenizer, train_retokenized_text=True)
