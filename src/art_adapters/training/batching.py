"""Micro-batches of a training step: rows grouped under a token budget, a trajectory's rows always together."""

from __future__ import annotations

from .tokenize import TrainSequence


def trajectory_of(sequence: TrainSequence) -> tuple[int, int]:
    """The trajectory a training row belongs to."""
    return (sequence.group_index, sequence.trajectory_index)


def pack_micro_batches(lengths: list[int], budget: int, units: list[object] | None = None) -> list[list[int]]:
    """Indices grouped so each batch's padded size (rows x longest row) fits `budget`; longest first. Rows of one
    unit (a trajectory's sequences) always share a batch, so its per-trajectory terms stay exact."""
    keys = units if units is not None else list(range(len(lengths)))
    members: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for rows in sorted(members.values(), key=lambda rows: -max(lengths[i] for i in rows)):
        longest = max(lengths[i] for i in rows)
        if current and max(width, longest) * (len(current) + len(rows)) > budget:
            batches.append(current)
            current, width = [], 0
        current.extend(rows)
        width = max(width, longest)
    if current:
        batches.append(current)
    return batches
