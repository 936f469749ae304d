"""2048 trained the way ART's 2048 example trains it: the latest checkpoint pulled from S3 before training, RULER
("openai/o4-mini") scoring each group as it finishes (`after_each`, groups it cannot judge dropped), the model
folder pushed to S3 before every step.

Written as an ART user writes it; porting changed only the imports (`art_adapters`), plus the base model, sizes and
a smaller winning tile (ART's `TRAIN_STEPS` and `SIMULTANEOUS_GAMES` are flags here). W&B Weave tracing is left out.
The judge is called through LiteLLM as in ART, so `OPENAI_API_KEY` (and `OPENAI_BASE_URL` for another
OpenAI-compatible server) choose where it runs; the bucket is `BACKUP_BUCKET`.

BACKUP_BUCKET=my-bucket python examples/art_ports/game_2048.py --base-model Qwen/Qwen2.5-3B-Instruct --steps 40
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import xml.etree.ElementTree as ET

import openai

import art_adapters as art
from art_adapters.local import LocalBackend
from art_adapters.rewards import ruler_score_group

WINNING_VALUE = 64
SIZE = 4


def new_game() -> list[list[int | None]]:
    board: list[list[int | None]] = [[None] * SIZE for _ in range(SIZE)]
    add_tile(board)
    add_tile(board)
    return board


def add_tile(board: list[list[int | None]]) -> None:
    empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if board[r][c] is None]
    row, column = random.choice(empty)
    board[row][column] = 2 if random.random() < 0.9 else 4


def render(board: list[list[int | None]]) -> str:
    width = max(len(str(cell)) for row in board for cell in row if cell is not None)
    return "\n".join("|".join(str(cell or "_").rjust(width) for cell in row) for row in board) + "\n"


def slide(line: list[int | None]) -> list[int | None]:
    """One row slid toward its start, equal neighbours merged once."""
    tiles = [cell for cell in line if cell is not None]
    merged: list[int | None] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            merged.append(tiles[0] * 2)
            tiles = tiles[2:]
        else:
            merged.append(tiles.pop(0))
    return merged + [None] * (SIZE - len(merged))


def move(board: list[list[int | None]], direction: str) -> None:
    columns = [list(col) for col in zip(*board, strict=True)]
    lines = {
        "left": board,
        "right": [r[::-1] for r in board],
        "up": columns,
        "down": [c[::-1] for c in columns],
    }
    slid = [slide(line) for line in lines[direction]]
    if direction == "right":
        slid = [r[::-1] for r in slid]
    if direction == "down":
        slid = [c[::-1] for c in slid]
    if direction in ("up", "down"):
        slid = [list(r) for r in zip(*slid, strict=True)]
    board[:] = slid


def apply_agent_move(board: list[list[int | None]], reply: str) -> None:
    try:
        direction = (ET.fromstring(reply.strip()).text or "").strip()
    except ET.ParseError as error:
        raise ValueError("Invalid xml") from error
    if direction not in ("left", "right", "up", "down"):
        raise ValueError("Invalid direction")
    move(board, direction)
    add_tile(board)


def max_cell(board: list[list[int | None]]) -> int:
    return max(cell for row in board for cell in row if cell is not None)


def finished(board: list[list[int | None]]) -> bool:
    return max_cell(board) >= WINNING_VALUE or all(cell is not None for row in board for cell in row)


@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout(model: art.Model, step: int, is_validation: bool) -> art.Trajectory:
    board = new_game()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": "You are an excellent 2048 player. Choose the move most likely to combine cells. "
                "Moves: 'left', 'right', 'up', 'down'. Reply with one XML element, like <move>left</move>",
            }
        ],
        metadata={"step": step, "validation": is_validation},
        reward=0,
    )
    moves = 0
    while True:
        trajectory.messages_and_choices.append({"role": "user", "content": render(board)})
        completion = await model.openai_client().chat.completions.create(
            max_completion_tokens=16, messages=trajectory.messages(), model=model.get_inference_name()
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        try:
            apply_agent_move(board, choice.message.content or "")
            moves += 1
        except ValueError:
            trajectory.metrics["invalid_move"] = 1
            trajectory.reward = -1
            break
        if finished(board):
            trajectory.metrics["invalid_move"] = 0
            break
    top = max_cell(board)
    trajectory.metrics.update(max_value=top, num_moves=moves, win=top == WINNING_VALUE)
    if trajectory.metrics["invalid_move"] == 0:
        trajectory.reward = (
            2 if top == WINNING_VALUE else (math.log2(top) - 1) / (math.log2(WINNING_VALUE) - 1)
        )
    return trajectory


async def train(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-3B-Instruct")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--games", type=int, default=18, help="simultaneous games (one group)")
    parser.add_argument("--path", default=".art")
    parser.add_argument("--no-ruler", action="store_true", help="train on the game's own reward")
    args = parser.parse_args(argv)
    random.seed(42)

    model = art.TrainableModel(name="tutorial-001", project="2048", base_model=args.base_model)
    model._internal_config = art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=8192))
    backend = LocalBackend(path=args.path)
    await model.register(backend)
    await backend._experimental_pull_from_s3(model, verbose=True)
    print(f"training from step {await model.get_step()}")

    for i in range(await model.get_step(), args.steps):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, i, is_validation=False) for _ in range(args.games)),),
            after_each=lambda group: (
                None if args.no_ruler else ruler_score_group(group, "openai/o4-mini", swallow_exceptions=True)
            ),
            pbar_desc="gather",
            max_exceptions=10,
        )
        await backend._experimental_push_to_s3(model)  # ART backs up before each step
        metrics = await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-5))
        judged = sum("ruler_score" in t.metrics for g in train_groups for t in g)
        print(
            f"step {await model.get_step()}: judged {judged} trained_tokens {metrics.get('trained_tokens', 0):.0f}"
        )
    await backend.close()


if __name__ == "__main__":
    asyncio.run(train())
