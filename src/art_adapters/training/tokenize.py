"""Trajectory -> training sequences: captured prompt ids as context, the engine's sampled ids as trained tokens.

Re-tokenization happens only for context (a hand-built Choice without prompt ids), never for trained tokens.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from openai.types.chat.chat_completion import Choice

from ..capture.sampling import unreproducible_settings
from ..trajectories import History, LLMCall, Message, Tools, Trajectory, messages_of

log = logging.getLogger(__name__)

NAN = float("nan")


class ChatTokenizer(Protocol):
    """What we need of a Hugging Face tokenizer."""

    def __len__(self) -> int: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class TokenizationError(ValueError):
    """A trajectory's token ids cannot be trained on with this tokenizer."""


@dataclass
class TrainSequence:
    """One training row: context and sampled tokens of one conversation history.

    `trained_mask[i]` is 1 where `input_ids[i]` was sampled by the engine (its logprob is `sampled_logprobs[i]`,
    NaN when the engine returned none); 0 for prompt, tool, template and truncated tokens.
    """

    input_ids: list[int]
    trained_mask: list[int]
    sampled_logprobs: list[float]
    temperature: float = 1.0
    advantage: float = 0.0
    group_index: int = 0
    trajectory_index: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained_mask)


@dataclass
class Sample:
    """One sampled completion and the exact prompt it was sampled from. `excluded`: why its logprobs are not of a
    distribution the trainer reproduces (they are dropped: NaN, no importance ratio), or None."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    temperature: float
    excluded: str | None = None


@dataclass
class TokenizedTrajectory:
    sequences: list[TrainSequence] = field(default_factory=list)
    skipped: bool = False
    truncated_tokens: int = 0
    reason: str = ""
    excluded_tokens: int = 0  # sampled tokens trained without an importance ratio (see Sample.excluded)
    excluded_reasons: set[str] = field(default_factory=set)


def tokenize_trajectory(
    trajectory: Trajectory,
    tokenizer: ChatTokenizer,
    *,
    max_seq_len: int,
    vocab_size: int | None = None,
    group_index: int = 0,
    trajectory_index: int = 0,
    advantage: float = 0.0,
    train_unkept_choices: bool = False,
) -> TokenizedTrajectory:
    """Turn one trajectory into training sequences (see the module docstring); skipped if nothing was sampled.

    Of a call's n > 1 choices, only those the agent kept (continued by a later call, or appended as a Choice)
    are trained, the first choice when none was; `train_unkept_choices` trains them all under the reward."""
    name = f"trajectory {trajectory_index} of group {group_index}"
    samples = samples_of(trajectory, tokenizer, train_unkept_choices=train_unkept_choices)
    if not samples:
        reason = f"{name} has no sampled token ids (not captured through our client?); skipped"
        log.warning(reason)
        return TokenizedTrajectory(skipped=True, reason=reason)
    _check_vocab(samples, vocab_size if vocab_size is not None else len(tokenizer), name)

    out = sequences_from_samples(
        samples, max_seq_len=max_seq_len, group_index=group_index, trajectory_index=trajectory_index
    )
    for sample in samples:
        if sample.excluded:
            out.excluded_tokens += len(sample.completion_ids)
            out.excluded_reasons.add(sample.excluded)
    for sequence in out.sequences:
        sequence.advantage = advantage
    if not out.sequences:
        out.skipped = True
        out.reason = f"{name}: every sampled token lies beyond max_seq_len={max_seq_len}; skipped"
        log.warning(out.reason)
    return out


def sequences_from_samples(
    samples: list[Sample], *, max_seq_len: int, group_index: int = 0, trajectory_index: int = 0
) -> TokenizedTrajectory:
    """Chain samples into sequences (a prompt that extends a sequence continues it), then truncate."""
    sequences: list[TrainSequence] = []
    for sample in samples:
        sequence = _extended_sequence(sequences, sample)
        if sequence is None:
            sequence = TrainSequence(
                input_ids=[],
                trained_mask=[],
                sampled_logprobs=[],
                temperature=sample.temperature,
                group_index=group_index,
                trajectory_index=trajectory_index,
            )
            sequences.append(sequence)
        context = sample.prompt_ids[len(sequence.input_ids) :]
        sequence.input_ids += context + sample.completion_ids
        sequence.trained_mask += [0] * len(context) + [1] * len(sample.completion_ids)
        sequence.sampled_logprobs += [NAN] * len(context) + sample.logprobs

    out = TokenizedTrajectory()
    for sequence in sequences:
        if len(sequence.input_ids) > max_seq_len:
            out.truncated_tokens += sum(sequence.trained_mask[max_seq_len:])
            del sequence.input_ids[max_seq_len:], sequence.trained_mask[max_seq_len:]
            del sequence.sampled_logprobs[max_seq_len:]
        # Position 0 has no prefix to predict it from, so it is never trained.
        if sequence.trained_mask and sequence.trained_mask[0]:
            sequence.trained_mask[0] = 0
        if sequence.num_trained > 0:
            out.sequences.append(sequence)
    return out


def _extended_sequence(sequences: list[TrainSequence], sample: Sample) -> TrainSequence | None:
    """The newest sequence whose tokens the sample's prompt extends token for token (same temperature)."""
    for sequence in reversed(sequences):
        n = len(sequence.input_ids)
        if (
            n <= len(sample.prompt_ids)
            and sequence.temperature == sample.temperature
            and sample.prompt_ids[:n] == sequence.input_ids
        ):
            return sequence
    return None


def _check_vocab(samples: list[Sample], vocab_size: int, name: str) -> None:
    for sample in samples:
        for token in (*sample.prompt_ids, *sample.completion_ids):
            if not 0 <= token < vocab_size:
                raise TokenizationError(
                    f"{name}: token id {token} is outside the tokenizer's vocabulary (size {vocab_size}) "
                    "- token ids from a different tokenizer?"
                )


# --- where the samples come from ------------------------------------------------------------------------


def samples_of(
    trajectory: Trajectory, tokenizer: ChatTokenizer, *, train_unkept_choices: bool = False
) -> list[Sample]:
    """Every sampled completion of the trajectory, in order: captured calls first, then hand-built Choices.

    A Choice whose sampled ids equal a captured call's is the same sample (the conversation view of the call)
    and is not counted twice. Unkept choices of n > 1 calls are left out (see `tokenize_trajectory`).
    """
    histories: list[History | Trajectory] = [trajectory, *trajectory.additional_histories]
    per_call: list[list[Sample]] = []
    calls_seen: set[tuple[Any, ...]] = set()
    for history in histories:
        for call in history.llm_calls:  # a history may list calls the trajectory lists too (`finish()`)
            key = (
                call.started_at,
                tuple(call.prompt_token_ids or ()),
                tuple(call.completion_token_ids or ()),
            )
            if key not in calls_seen:
                calls_seen.add(key)
                per_call.append(_samples_of_call(call))
    if not train_unkept_choices:
        per_call = _kept_choices(per_call, _choice_ids(histories))
    samples = [s for call in per_call for s in call]
    seen = Counter(tuple(s.completion_ids) for s in samples)
    for history in histories:
        samples += _samples_of_choices(history.messages_and_choices, history.tools, tokenizer, seen)
    return samples


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


def _samples_of_call(call: LLMCall) -> list[Sample]:
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
            )
        )
    return samples


def chat_template_ids(
    tokenizer: ChatTokenizer,
    messages: list[Message],
    tools: Tools | None,
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Prompt ids of `messages` (+ tools), with the generation prompt by default, as vLLM renders them
    (`template_kwargs`: a request's `chat_template_kwargs`, such as Qwen3's `enable_thinking`)."""
    out = tokenizer.apply_chat_template(
        as_vllm_renders(messages),
        tools=tools or None,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **template_kwargs,
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def as_vllm_renders(messages: list[Message]) -> list[Message]:
    """Messages as vLLM hands them to the chat template: tool-call `arguments` parsed from JSON into a dict, and
    anything that is not a JSON object (null, "", malformed, a list) rendered as `{}`; reasoning as below."""
    out: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_with_parsed_arguments(call) for call in calls]}
        if message.get("role") == "assistant" and ("reasoning" in message or "reasoning_content" in message):
            # vLLM reads an assistant turn's reasoning from `reasoning` only and hands it to the template as both
            # names; a `reasoning_content` the client sends is not rendered.
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
            if message.get("reasoning") is not None:
                message["reasoning_content"] = message["reasoning"]
        out.append(message)
    return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


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
    """Supervised data: each assistant turn re-rendered by the chat template (fine here: nothing was sampled)."""
    samples: list[Sample] = []
    histories: list[History | Trajectory] = [trajectory, *trajectory.additional_histories]
    for history in histories:
        messages = history.messages()
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prefix = chat_template_ids(tokenizer, messages[:i], history.tools)
            full = chat_template_ids(tokenizer, messages[: i + 1], history.tools, add_generation_prompt=False)
            if full[: len(prefix)] != prefix or len(full) == len(prefix):
                log.warning(
                    "assistant turn %d does not extend its prompt under the chat template; skipped", i
                )
                continue
            samples.append(Sample(prefix, full[len(prefix) :], [NAN] * (len(full) - len(prefix)), 1.0))
    return samples
