"""The demo's task: questions about orders in the shop database, each answered by one of the agent's four tools with
the order's number from the question; the reward compares the tool's result with the database's own answer."""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..trajectories import Trajectory

# The database's answer to each kind of question, queried here (not through the agent's tools).
ANSWER_SQL = {
    "day": "SELECT order_date FROM orders WHERE id = ?",
    "name": "SELECT c.name FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.id = ?",
    "object": "SELECT p.name FROM order_items i JOIN products p ON p.id = i.product_id WHERE i.order_id = ? "
    "ORDER BY p.id",
    "result": "SELECT status FROM orders WHERE id = ?",
}
# Every question asks when an order was placed, so one tool of the four answers it: `day`, with the order's number
# from the question. (A task of two questions per tool, four tools, did not learn in minutes at this size: success
# 0.09 at step 0 and 0.09-0.17 over the next 11 steps; docs/getting-started.md.)
TEMPLATES = [
    ("When was order {id} placed?", "day"),
    ("What day did order {id} come in?", "day"),
    ("When did I place order {id}?", "day"),
    ("What date is on order {id}?", "day"),
    ("Since when is order {id} open?", "day"),
    ("When was order {id} made?", "day"),
    ("On which day was order {id} placed?", "day"),
    ("Date of order {id}?", "day"),
]
REPLY = "Here is what I found."  # the warm start's closing reply (the reward reads the tool's result)


@dataclass(frozen=True)
class Question:
    text: str
    tool: str  # the tool that answers it
    order_id: int
    answer: str  # the database's answer


def database_answer(db_path: str | Path, tool: str, order_id: int) -> str:
    """The answer as the tools format it: the values, comma-separated."""
    db = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = db.execute(ANSWER_SQL[tool], (order_id,)).fetchall()
    finally:
        db.close()
    return ", ".join(str(value) for row in rows for value in row)


def questions(db_path: str | Path, seed: int = 0) -> list[Question]:
    """One question per template, each about its own order among orders 1-9 (a one-digit argument: one token for
    the tiny model to take from the question)."""
    rng = random.Random(seed)
    ids = rng.sample(range(1, 10), len(TEMPLATES))
    return [
        Question(text.format(id=order_id), tool, order_id, database_answer(db_path, tool, order_id))
        for (text, tool), order_id in zip(TEMPLATES, ids, strict=True)
    ]


def reward(question: Question, messages: list[Any]) -> float:
    """1 when the agent made one tool call and its result is the database's answer; 0.2 for a well-formed call
    that answered something else (wrong tool or order); 0 when it called no tool (a broken call is the worst)."""
    results = [m for m in messages if getattr(m, "type", None) == "tool"]
    if not results:
        return 0.0
    return 1.0 if len(results) == 1 and results[0].content == question.answer else 0.2


def warm_start_examples(
    db_path: str | Path, tools: list[dict[str, Any]], system: str, count: int, seed: int = 0
) -> list[Trajectory]:
    """The tool-call format as the agent's graph sends it (system prompt, tools, the call with the order's id from
    the question, the tool's real result, a closing reply). Each question's examples call the four tools equally
    often (in rounds of the four, shuffled): the examples favour no tool, and RL must learn which tool answers it.
    (The start still varies with the seed: 0.05 to 0.27 success over seeds 0-3, where chance is 0.25. Tools drawn
    independently gave the asked tool 7 to 17 of 64 examples across seeds.)"""
    rng = random.Random(seed)
    asked = questions(db_path, seed)
    names = [t["function"]["name"] for t in tools]
    rounds: dict[int, list[str]] = {}  # each question's tools still to use in its current round
    out = []
    for i in range(count):
        question = asked[i % len(asked)]
        if not rounds.get(i % len(asked)):
            rounds[i % len(asked)] = rng.sample(names, len(names))
        name = rounds[i % len(asked)].pop()
        arguments = json.dumps({"order_id": question.order_id})
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": question.text},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": database_answer(db_path, name, question.order_id),
            },
            {"role": "assistant", "content": REPLY},
        ]
        out.append(Trajectory(messages_and_choices=messages, tools=tools, reward=1.0))
    return out
