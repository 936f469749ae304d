"""`art_adapters.utils.sft` (ART's path): supervised fine-tuning from a JSONL file of chats, streamed, with one
learning-rate schedule (warmup, then linear / cosine / constant) over the whole run, in chunks or in one call."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..config import SFTConfig
from ..trajectories import Trajectory

if TYPE_CHECKING:
    from ..model import TrainableModel

Schedule = Literal["cosine", "linear", "constant"]


class SFTChunk(NamedTuple):
    """One `model.train_sft` call's share of a run: its trajectories and their slice of the schedule."""

    trajectories: list[Trajectory]
    config: SFTConfig
    step: int  # the run's batch index at the chunk's first batch
    epoch: int
    epoch_step: int


def _jsonl_only(file_path: str) -> None:
    if not file_path.endswith(".jsonl"):
        raise ValueError(f"Only JSONL files are supported. Got: {file_path}")


def _trajectory(line: str, where: str) -> Trajectory:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error})") from error
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ValueError(f"{where}: each line needs a 'messages' list (and optionally 'tools')")
    return Trajectory(messages_and_choices=row["messages"], tools=row.get("tools"))


def get_file_row_count(file_path: str) -> int:
    """Non-empty lines of a JSONL file."""
    _jsonl_only(file_path)
    with open(file_path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: Schedule = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """One rate per step: a linear warmup from `min_lr` to `peak_lr` over `warmup_steps` (the first step already
    above `min_lr`), then `method` from `peak_lr` down to `min_lr` at the last step."""
    if method not in ("cosine", "linear", "constant"):
        raise ValueError(f"Unknown method: {method}. Choose from: cosine, linear, constant")
    rates = []
    decay_steps = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(peak_lr)
    return rates


def create_sft_dataset_iterator(
    trajectories: list[Trajectory],
    chunk_size: int = 10,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    shuffle: bool = True,
    seed: int = 42,
    initial_step: int = 0,
    show_progress: bool = True,
) -> Iterator[SFTChunk]:
    """The run in chunks of `chunk_size` batches, each with its slice of the whole run's schedule, so each
    `model.train_sft(chunk.trajectories, chunk.config)` logs its own metrics; every epoch reshuffled
    (seed + epoch); `initial_step` (a batch index) resumes."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not trajectories:
        return
    per_epoch = math.ceil(len(trajectories) / batch_size)
    total = per_epoch * epochs
    schedule = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    progress = _progress(show_progress, initial_step, total)
    chunks_per_epoch = math.ceil(per_epoch / chunk_size)
    for epoch in range(epochs):
        order = list(trajectories)
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for index, first_batch in enumerate(range(0, per_epoch, chunk_size)):
            if epoch * chunks_per_epoch + index < initial_step // chunk_size:
                continue  # a chunk already trained
            step = epoch * per_epoch + first_batch
            batches = min(chunk_size, per_epoch - first_batch)
            chunk = order[first_batch * batch_size : (first_batch + batches) * batch_size]
            rates = schedule[step : step + batches]
            yield SFTChunk(
                chunk, SFTConfig(learning_rate=rates, batch_size=batch_size), step, epoch, first_batch
            )
            if progress is not None:
                progress.update(batches)
    if progress is not None:
        progress.close()


def iterate_file(
    file_path: str,
    epochs: int = 1,
    shuffle_buffer_size: int = 10000,
    seed: int = 42,
    initial_skip: int = 0,
) -> Iterator[Trajectory]:
    """Trajectories from a JSONL file (`{"messages": [...], "tools": [...]}` per line), `epochs` times, shuffled
    through a buffer of `shuffle_buffer_size` rows so the file never has to fit in memory."""
    _jsonl_only(file_path)
    shuffled = itertools.chain.from_iterable(
        _buffer_shuffled(_rows(file_path), shuffle_buffer_size, random.Random(seed + epoch))
        for epoch in range(epochs)
    )
    return itertools.islice(shuffled, initial_skip, None)


def _rows(file_path: str) -> Iterator[Trajectory]:
    with open(file_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _trajectory(line, f"{file_path} line {number}")


def _buffer_shuffled(rows: Iterator[Trajectory], size: int, rng: random.Random) -> Iterator[Trajectory]:
    """Rows in random order, holding at most `size` of them: once full, a random one leaves for each that comes."""
    buffer: list[Trajectory] = []
    for row in rows:
        buffer.append(row)
        if len(buffer) >= size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


async def train_sft_from_file(
    model: TrainableModel,
    file_path: str,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: dict[str, Any] | None = None,
    verbose: bool = False,
    shuffle_buffer_size: int = 10000,
) -> None:
    """Supervised fine-tuning of a registered model on a JSONL file, batches `initial_step` to `final_step`
    (exclusive) of the whole run's schedule, in one `model.train_sft` call."""
    rows = get_file_row_count(file_path)
    total = math.ceil(rows * epochs / batch_size)
    schedule = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    rates = schedule[initial_step : min(final_step, total) if final_step is not None else None]
    if not rates:
        if verbose:
            print("No trajectories to train on" if rows == 0 else f"initial_step {initial_step} skips all")
        return
    if verbose:
        print(f"Training {len(rates)} batches of {batch_size} ({schedule_type}, peak_lr {peak_lr})")
    stream = iterate_file(file_path, epochs, shuffle_buffer_size, initial_skip=initial_step * batch_size)
    chats = list(itertools.islice(stream, len(rates) * batch_size))
    await model.train_sft(chats, SFTConfig(learning_rate=rates, batch_size=batch_size), _config, verbose)


def _progress(show: bool, initial: int, total: int) -> Any:
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(initial=initial, total=total, desc="SFT Training", unit="step")


__all__ = [
    "SFTChunk",
    "create_lr_schedule",
    "create_sft_dataset_iterator",
    "get_file_row_count",
    "iterate_file",
    "train_sft_from_file",
]
