"""ART's `Trajectory.tokenize()` / `LegacyHistory.tokenize()` (PRs #773, #782) on our samples: each history as
token ids, sampled logprobs and `TokenFlag`s; a later prompt that does not extend the tokens sampled before it
starts a new history, unless `reconcile_text_equivalent_tokenizations` and only the tokenization of the same text
differs (the sampled tokens are kept, the prompt's re-tokenization of them dropped)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..history import History
from ..tokenized import TokenFlag, TokenizedHistory
from ..trajectories import Trajectory
from .render import chat_template_ids
from .samples import NAN, Sample, rendered_turn, samples_of


@dataclass
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    flags: list[TokenFlag] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float], flag: TokenFlag) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.flags += [flag] * len(ids)


def tokenize_source(
    source: Trajectory | History,
    *,
    reconcile_text_equivalent_tokenizations: bool,
    model: str | None,
    base_model: str | None,
    tokenizer: Any,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, object] | None,
) -> list[TokenizedHistory]:
    """The token sequences of a trajectory (its histories included) or of one history, in sampling order."""
    if tokenizer is None:
        if not base_model:
            raise ValueError("tokenize() needs tokenizer= or base_model= (a Hugging Face model id or folder)")
        tokenizer = _pretrained(base_model)
    tokenizer = _Templated(tokenizer, chat_template, dict(chat_template_kwargs or {}))
    trajectory = (
        source
        if isinstance(source, Trajectory)
        else Trajectory(
            messages_and_choices=source.messages_and_choices, tools=source.tools, llm_calls=source.llm_calls
        )
    )
    samples = samples_of(trajectory, tokenizer) + _rendered_choices(trajectory, tokenizer)
    name = model or _model_of(trajectory) or base_model or ""
    if not samples:  # nothing sampled: the conversation as the template renders it, all prompt
        ids = chat_template_ids(
            tokenizer, trajectory.messages(), trajectory.tools, add_generation_prompt=False
        )
        return [
            TokenizedHistory(
                model=name, token_ids=ids, logprobs=[NAN] * len(ids), flags=[TokenFlag(0)] * len(ids)
            )
        ]
    sequences: list[_Sequence] = []
    for sample in samples:
        prompt_flag = TokenFlag.EXACT if sample.prompt_exact else TokenFlag(0)
        sampled_flag = TokenFlag.SAMPLED | (TokenFlag.EXACT if sample.sampled else TokenFlag(0))
        sequence, rest = _continued(sequences, sample, tokenizer, reconcile_text_equivalent_tokenizations)
        if sequence is None:
            sequence, rest = _Sequence(), sample.prompt_ids
            sequences.append(sequence)
        sequence.add(rest, [NAN] * len(rest), prompt_flag)
        sequence.add(sample.completion_ids, sample.logprobs, sampled_flag)
    return [TokenizedHistory(model=name, **vars(s)) for s in sequences]


def _continued(
    sequences: list[_Sequence], sample: Sample, tokenizer: Any, reconcile: bool
) -> tuple[_Sequence | None, list[int]]:
    """The newest sequence the sample's prompt continues, and the prompt tokens still to append: a prompt that
    extends it token for token; with `reconcile`, also one whose tokens after the common prefix only re-tokenize
    the text of the sequence's remaining tokens."""
    prompt = sample.prompt_ids
    for sequence in reversed(sequences):
        have = sequence.token_ids
        common = 0
        for a, b in zip(have, prompt, strict=False):
            if a != b:
                break
            common += 1
        if common == len(have):
            return sequence, prompt[common:]
        if reconcile:
            end = _text_equivalent_end(have[common:], prompt, common, tokenizer)
            if end is not None:
                return sequence, prompt[end:]
    return None, []


def _text_equivalent_end(tail: list[int], prompt: list[int], start: int, tokenizer: Any) -> int | None:
    """The end of the shortest `prompt[start:end]` that decodes to the same text as `tail`, or None."""
    text = tokenizer.decode(tail)
    for end in range(start + 1, len(prompt) + 1):
        piece = tokenizer.decode(prompt[start:end])
        if piece == text:
            return end
        if len(piece) > len(text) or not text.startswith(piece.rstrip("\ufffd")):
            return None
    return None


def _rendered_choices(trajectory: Trajectory, tokenizer: Any) -> list[Sample]:
    """Choices without token ids (a server that returns none): sampled, but their ids rendered by the template
    (ART's SAMPLED without EXACT). Plain assistant messages stay prompt, as ART's legacy tokenization has it."""
    out = []
    for history in [trajectory, *trajectory.additional_histories]:
        for i, item in enumerate(history.messages_and_choices):
            if isinstance(item, Choice) and not (item.model_extra or {}).get("token_ids"):
                messages = history.messages()
                reasoning = _reasoning(item)
                if reasoning:  # what the model sampled includes its thinking: the template renders it
                    messages[i] = {**messages[i], "reasoning": reasoning}
                turn = rendered_turn(tokenizer, messages, i, history.tools)
                if turn is not None:
                    prompt, completion = turn
                    out.append(
                        Sample(
                            prompt,
                            completion,
                            _logprobs(item, len(completion)),
                            1.0,
                            origin="text",
                            prompt_exact=False,
                        )
                    )
    return out


def _reasoning(choice: Choice) -> str | None:
    """The Choice's reasoning: vLLM's `reasoning_content` (its older name, ART's) or `reasoning`."""
    extra = choice.message.model_extra or {}
    value = extra.get("reasoning_content") or extra.get("reasoning")
    return value if isinstance(value, str) else None


def _logprobs(choice: Choice, n: int) -> list[float]:
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None or len(content) != n:
        return [NAN] * n
    return [float(c.logprob) if math.isfinite(c.logprob) else NAN for c in content]


def _model_of(trajectory: Trajectory) -> str | None:
    for call in trajectory.llm_calls:
        name = call.served_model or call.request.get("model")
        if isinstance(name, str) and name:
            return name
    return None


@lru_cache(maxsize=4)
def _pretrained(base_model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


class _Templated:
    """A tokenizer whose `apply_chat_template` uses the given template and template kwargs (ART's arguments)."""

    def __init__(self, tokenizer: Any, chat_template: str | None, kwargs: dict[str, object]) -> None:
        self._tokenizer, self._template, self._kwargs = tokenizer, chat_template, kwargs

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        if self._template is not None:
            kwargs.setdefault("chat_template", self._template)
        return self._tokenizer.apply_chat_template(conversation, **{**self._kwargs, **kwargs})

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
