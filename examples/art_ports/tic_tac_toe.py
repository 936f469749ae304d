"""Tic-tac-toe trained the way ART's tic-tac-toe example trains it: checkpoints backed up to S3 after every step and
pulled before the run (so a new machine carries on where the bucket left off), old checkpoints deleted, and the
final step deployed to Together and played through Together's API.

Written as an ART user writes it; porting changed only the imports (`art_adapters`), plus the base model, sizes and
flags (ART's are constants at the top of the file) and one address: Together's URL comes from `TOGETHER_BASE_URL`
when set. W&B Weave tracing is left out. The bucket is `BACKUP_BUCKET`; credentials and endpoint (MinIO, R2, ...)
come from the standard AWS variables.

BACKUP_BUCKET=my-bucket python examples/art_ports/tic_tac_toe.py --base-model Qwen/Qwen2.5-3B-Instruct --steps 50
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import xml.etree.ElementTree as ET

import openai
from pydantic import BaseModel

import art_adapters as art
from art_adapters.utils.deployment import TogetherDeploymentConfig, deploy_model

ROWS, COLUMNS = "ABC", "123"


class TicTacToeScenario(BaseModel):
    step: int


def new_game() -> dict:
    agent = random.choice("xo")
    return {"board": [["_"] * 3 for _ in range(3)], "agent": agent, "opponent": "o" if agent == "x" else "x"}


def render(game: dict) -> str:
    header = "  " + " ".join(COLUMNS)
    return "\n".join([header] + [f"{ROWS[i]} " + " ".join(row) for i, row in enumerate(game["board"])])


def winner(board: list[list[str]]) -> str | None:
    lines = [*board, *([board[r][c] for r in range(3)] for c in range(3))]
    lines += [[board[i][i] for i in range(3)], [board[i][2 - i] for i in range(3)]]
    for line in lines:
        if line[0] != "_" and line.count(line[0]) == 3:
            return line[0]
    return "draw" if all(cell != "_" for row in board for cell in row) else None


def play_agent_move(game: dict, reply: str) -> None:
    """Raises ValueError for anything but `<move>B2</move>` naming an empty square."""
    try:
        square = (ET.fromstring(reply.strip()).text or "").strip().upper()
    except ET.ParseError as error:
        raise ValueError("not a <move> element") from error
    if len(square) != 2 or square[0] not in ROWS or square[1] not in COLUMNS:
        raise ValueError(f"no such square {square!r}")
    row, column = ROWS.index(square[0]), COLUMNS.index(square[1])
    if game["board"][row][column] != "_":
        raise ValueError(f"{square} is taken")
    game["board"][row][column] = game["agent"]


def play_opponent_move(game: dict) -> None:
    empty = [(r, c) for r in range(3) for c in range(3) if game["board"][r][c] == "_"]
    row, column = random.choice(empty)
    game["board"][row][column] = game["opponent"]


@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout(model: art.Model, scenario: TicTacToeScenario) -> art.Trajectory:
    game = new_game()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": "You are a tic-tac-toe player. Reply with your move as <move>B2</move> (rows A-C, "
                f"columns 1-3). You play {game['agent']}.",
            }
        ],
        reward=0,
        metadata={"step": scenario.step},
    )
    if game["agent"] == "o":
        play_opponent_move(game)
    moves, invalid = 0, False
    while winner(game["board"]) is None:
        trajectory.messages_and_choices.append({"role": "user", "content": render(game)})
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), max_completion_tokens=16
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        try:
            play_agent_move(game, choice.message.content or "")
        except ValueError:
            invalid = True
            trajectory.reward = -1 + math.log(moves + 1) / math.log(100)  # longer legal play is better
            break
        moves += 1
        if winner(game["board"]) is None:
            play_opponent_move(game)
    result = winner(game["board"])
    if result is not None:
        trajectory.reward = {game["agent"]: 1.0, game["opponent"]: 0.0, "draw": 0.5}[result]
        trajectory.metrics["win"] = trajectory.reward
    trajectory.metrics["num_moves"] = moves
    trajectory.metrics["invalid_move"] = int(invalid)
    return trajectory


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-3B-Instruct")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--games", type=int, default=96, help="rollouts per step (one group)")
    parser.add_argument("--path", default=".art")
    parser.add_argument("--pull-from-s3", action="store_true")
    parser.add_argument("--deploy", action="store_true", help="deploy the last step to Together and play it")
    args = parser.parse_args(argv)
    random.seed(42)

    from art_adapters.local.backend import LocalBackend

    backend = LocalBackend(path=args.path)
    model = art.TrainableModel(name="tic-tac-toe-001", project="tic-tac-toe", base_model=args.base_model)

    if args.pull_from_s3:
        print("pulling from s3")
        await backend._experimental_pull_from_s3(model)

    print("registering")
    await model.register(backend)
    print(f"training from step {await model.get_step()}")
    for i in range(await model.get_step(), args.steps):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, TicTacToeScenario(step=i)) for _ in range(args.games)),),
            pbar_desc="gather",
        )
        await model.delete_checkpoints()
        metrics = await model.train(train_groups, config=art.TrainConfig(learning_rate=5e-5))
        await backend._experimental_push_to_s3(model)
        print(f"step {await model.get_step()}: trained_tokens {metrics.get('trained_tokens', 0):.0f}")

    if args.deploy:
        step = await model.get_step()
        checkpoint_path = await backend._experimental_pull_model_checkpoint(
            model, step=step, s3_bucket=os.environ.get("BACKUP_BUCKET"), verbose=True
        )
        deployment = await deploy_model(
            model=model,
            checkpoint_path=checkpoint_path,
            step=step,
            provider="together",
            config=TogetherDeploymentConfig(
                s3_bucket=os.environ.get("BACKUP_BUCKET"), wait_for_completion=True
            ),
            verbose=True,
        )
        together = os.environ.get("TOGETHER_BASE_URL", "https://api.together.xyz")
        deployed = art.Model(
            name=deployment.inference_model_name,
            project="tic-tac-toe",
            inference_api_key=os.environ["TOGETHER_API_KEY"],
            inference_base_url=f"{together}/v1",
            inference_model_name=deployment.inference_model_name,
        )
        game = await rollout(deployed, TicTacToeScenario(step=0))
        print(f"deployed {deployment.inference_model_name}: played {game.metrics['num_moves']} moves")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
