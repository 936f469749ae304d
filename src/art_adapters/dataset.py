"""Walk a training set in steps: seeded shuffles per epoch, resumable at any step (ART's `iterate_dataset`)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """The items of one step: `step` counts over all epochs, `epoch_step` within `epoch` (both from 0)."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` items, epoch after epoch, each epoch in its own seeded order (seed = epoch).

    `initial_step` skips the steps already taken, so `iterate_dataset(..., initial_step=await model.get_step())`
    resumes where a run stopped and sees the same batches it would have seen.
    """
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, not {groups_per_step}")
    if num_epochs < 0 or initial_step < 0:
        raise ValueError("num_epochs and initial_step must be >= 0")
    items = list(dataset)
    if not items:
        return
    steps_per_epoch = math.ceil(len(items) / groups_per_step)
    bar = None
    if use_tqdm:
        from .progress import progress_bar

        bar = progress_bar(steps_per_epoch * num_epochs, "dataset", "step", initial=initial_step)
    try:
        for epoch in range(num_epochs):
            order = list(range(len(items)))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chosen = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch([items[i] for i in chosen], step=step, epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
