"""Trajectory -> training sequences: captured prompt ids as context, the engine's sampled ids as trained tokens.

Re-tokenization happens only for context (a hand-built Choice without prompt ids), never for trained tokens
(unless the user asks for it: `TrainConfig.train_retokenized_text`, and the certificate then says so).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..sources import CallSource, SplitBy
from ..trajectories import Trajectory
from .render import ChatTokenizer, as_vllm_renders, chat_template_ids
from .samples import NAN, Sample, excluded_reason, samples_of, sft_samples

__all__ = [
    "ChatTokenizer",
    "Sample",
    "TokenizationError",
    "TokenizedTrajectory",
    "TrainSequence",
    "as_vllm_renders",
    "chat_template_ids",
    "chosen",
    "excluded_reason",
    "samples_of",
    "sequences_from_samples",
    "sft_samples",
    "tokenize_trajectory",
]

log = logging.getLogger(__name__)


class TokenizationError(ValueError):
    """A trajectory's token ids cannot be trained on with this tokenizer."""


@dataclass
class TrainSequence:
    """One training row: context and sampled tokens of one conversation history.

    `trained_mask[i]` is 1 where `input_ids[i]` was sampled by the engine (its logprob is `sampled_logprobs[i]`,
    NaN when the engine returned none); 0 for prompt, tool and template tokens and calls left out by
    `train_on`. `roles[i]`: the names the call a trained token came from answers to as a role
    (`CallSource.role_names()`, most specific first), so per-role rewards can give it its own advantage
    (`role_advantages`); `sampled[i]` is False only for re-tokenized text trained on request
    (`TrainConfig.train_retokenized_text`).
    """

    input_ids: list[int]
    trained_mask: list[int]
    sampled_logprobs: list[float]
    temperature: float = 1.0
    advantage: float = 0.0
    group_index: int = 0
    trajectory_index: int = 0
    roles: list[tuple[str, ...]] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    captured: list[bool] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # the policy version that sampled each token
    role_advantages: dict[str, float] = field(default_factory=dict)
    calls: list[int | None] = field(default_factory=list)  # per token: its call's index in `llm_calls`
    call_advantages: dict[int, float] = field(
        default_factory=dict
    )  # per call, `TrainConfig.advantage` != GRPO

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained_mask)

    @property
    def num_trained_sampled(self) -> int:
        return sum(1 for m, s in zip(self.trained_mask, self.sampled, strict=True) if m and s)

    @property
    def num_trained_captured(self) -> int:
        return sum(1 for m, c in zip(self.trained_mask, self.captured, strict=True) if m and c)

    def staleness_at(self, position: int, step: int) -> int:
        """How many steps behind the trainer (at `step`) the policy that sampled this token is (0 if unknown)."""
        version = self.versions[position] if self.versions else None
        return max(step - version, 0) if version is not None else 0

    def advantage_at(self, position: int) -> float:
        """The advantage of the trained token at `position`: its call's under turn-level credit (`call_advantages`,
        which already chose the call's role), else its role's (the first of its role names with a per-role
        reward) when the step has per-role rewards, else the trajectory's."""
        if self.call_advantages and self.calls:
            call = self.calls[position]
            if call is not None and call in self.call_advantages:
                return self.call_advantages[call]
        if self.role_advantages and self.roles:
            for role in self.roles[position]:
                if role in self.role_advantages:
                    return self.role_advantages[role]
        return self.advantage


@dataclass
class TokenizedTrajectory:
    sequences: list[TrainSequence] = field(default_factory=list)
    skipped: bool = False
    too_long: int = 0  # skipped for its length: its longest sequence's tokens (0: not too long)
    reason: str = ""
    skip_kind: str = ""  # why it was skipped, as a metric's suffix (`skipped_{skip_kind}`, see prepare.py)
    excluded_tokens: int = 0  # sampled tokens trained without an importance ratio (see Sample.excluded)
    excluded_reasons: set[str] = field(default_factory=set)
    left_out_tokens: int = 0  # sampled tokens of calls `train_on` did not choose (context only)
    missing_tokens: int = 0  # trained tokens whose sampled logprob the engine did not return (ratio 1)
    sources: list[CallSource] = field(default_factory=list)  # where the trajectory's samples came from

    @property
    def sampled_token_fraction(self) -> float:
        """Trained tokens the engine sampled / trained tokens (1.0 unless re-tokenized text was asked for)."""
        trained = sum(s.num_trained for s in self.sequences)
        return sum(s.num_trained_sampled for s in self.sequences) / trained if trained else 1.0

    @property
    def captured_token_fraction(self) -> float:
        """Trained tokens whose ids our transport recorded from the engine's answer / trained tokens; the rest
        came from Choices the rollout supplied (trusted as sampled) or re-tokenized text."""
        trained = sum(s.num_trained for s in self.sequences)
        return sum(s.num_trained_captured for s in self.sequences) / trained if trained else 1.0


TRAIN_ON_KEYS: dict[str, SplitBy] = {"nodes": "node", "agents": "agent", "roles": "role"}


def chosen(source: CallSource | None, train_on: dict[str, list[str]] | None) -> bool:
    """Whether a call from `source` is trained under `train_on` ({"nodes" | "agents" | "roles": names}, any
    matching key chooses it; None trains every call). A call with no recorded source is never chosen."""
    if not train_on:
        return True
    if source is None:
        return False
    return any(source.matches(TRAIN_ON_KEYS[key], set(names)) for key, names in train_on.items())


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
    train_on: dict[str, list[str]] | None = None,
    train_retokenized_text: bool = False,
    select: Callable[[CallSource | None], bool] | None = None,
) -> TokenizedTrajectory:
    """Turn one trajectory into training sequences (see the module docstring); skipped if nothing was sampled.

    Of a call's n > 1 choices, only those the agent kept (continued by a later call, or appended as a Choice)
    are trained, the first choice when none was; `train_unkept_choices` trains them all under the reward.
    `train_on` trains only the chosen calls' sampled tokens (the others stay in their sequences as context).
    `train_retokenized_text` also trains assistant turns that carry no sampled ids, re-rendered by the template.
    `select` (per-agent adapters): only calls from a source it accepts are trained, the others are context."""
    name = f"trajectory {trajectory_index} of group {group_index}"
    samples = samples_of(
        trajectory,
        tokenizer,
        train_unkept_choices=train_unkept_choices,
        train_retokenized_text=train_retokenized_text,
    )
    for sample in samples:
        sample.trained = chosen(sample.source, train_on) and (select is None or select(sample.source))
    if not samples:  # counted and reported once per step (prepare.py), not warned per trajectory
        reason = f"{name} has no sampled token ids (not captured through our client?); skipped"
        return TokenizedTrajectory(skipped=True, reason=reason, skip_kind="no_sampled_ids")
    _check_vocab(samples, vocab_size if vocab_size is not None else len(tokenizer), name)

    out = sequences_from_samples(
        samples, max_seq_len=max_seq_len, group_index=group_index, trajectory_index=trajectory_index
    )
    out.sources = [sample.source for sample in samples if sample.source is not None]
    if out.too_long:
        out.reason = f"{name} is {out.too_long} tokens long (max_seq_len={max_seq_len}); skipped"
        out.skip_kind = "too_long"
        return out
    for sample in samples:
        if not sample.trained:
            out.left_out_tokens += len(sample.completion_ids)
        elif sample.excluded:
            out.excluded_tokens += len(sample.completion_ids)
            out.excluded_reasons.add(sample.excluded)
        elif sample.sampled:
            out.missing_tokens += sum(1 for x in sample.logprobs if math.isnan(x))
    for sequence in out.sequences:
        sequence.advantage = advantage
    if not out.sequences:
        out.skipped = True
        if (train_on or select) and not any(s.trained for s in samples):
            out.reason = f"{name}: no call of it is among train_on={train_on}; skipped"
            out.skip_kind = "not_in_train_on"
        else:
            out.reason = f"{name} has no trainable token (only its first token was sampled); skipped"
            out.skip_kind = "no_trainable_token"
    return out


def sequences_from_samples(
    samples: list[Sample], *, max_seq_len: int, group_index: int = 0, trajectory_index: int = 0
) -> TokenizedTrajectory:
    """Chain samples into sequences (a prompt that extends a sequence continues it).

    A trajectory trains whole or not at all: if any of its sequences that train a token is longer than
    `max_seq_len` (cutting it would train a history the model never saw, under the whole trajectory's reward),
    none is returned, `skipped` is set and `too_long` holds the longest one's length. Sequences that each fit
    train, however many tokens they hold together: each is its own row."""
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
        n = len(sample.completion_ids)
        role = sample.source.role_names() if sample.source is not None else ()
        sequence.input_ids += context + sample.completion_ids
        sequence.trained_mask += [0] * len(context) + [int(sample.trained)] * n
        sequence.sampled_logprobs += [NAN] * len(context) + sample.logprobs
        sequence.roles += [()] * len(context) + [role] * n
        sequence.sampled += [True] * len(context) + [sample.sampled] * n
        sequence.captured += [True] * len(context) + [sample.origin == "captured"] * n
        sequence.versions += [None] * len(context) + sample.versions()
        sequence.calls += [None] * len(context) + [sample.call] * n

    out = TokenizedTrajectory()
    for sequence in sequences:
        # Position 0 has no prefix to predict it from, so it is never trained.
        if sequence.trained_mask and sequence.trained_mask[0]:
            sequence.trained_mask[0] = 0
        if sequence.num_trained > 0:
            out.sequences.append(sequence)
    longest = max((len(s) for s in out.sequences), default=0)
    if longest > max_seq_len:
        out.sequences, out.skipped, out.too_long = [], True, longest
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
