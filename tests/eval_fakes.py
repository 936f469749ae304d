"""For the evaluation harness's tests: a backend that serves a scripted OpenAI-compatible server's names as a
model's checkpointed steps, a grader whose "trained" step answers a known subset better, and an ART-style rollout.

The server speaks the real wire format over real HTTP; only which step answers what is scripted."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import art_adapters as art
from art_adapters.backend.base import InferenceEndpoint
from art_adapters.testing import Reply

PROJECT, NAME = "evalproj", "agent"
QUESTIONS = [{"id": f"q{i}", "question": f"what is {i} times 7?", "answer": str(i * 7)} for i in range(10)]
BASE_RIGHT = {"q0", "q2", "q5"}  # step 0 answers these right
IMPROVED = {"q1", "q4", "q7"}  # the trained step also answers these right
COIN = "q9"  # right on both steps exactly when the request's seed is even: same seeds, same outcome


class StepServingBackend:
    """Serves `{project}/{name}@{step}` for `steps` from a server at `base_url` (what LocalBackend's gateway does)."""

    def __init__(self, base_url: str, steps: Iterable[int]) -> None:
        self.base_url = base_url
        self.steps = sorted(steps)
        self.served: list[int] = []

    async def register(self, model: art.Model) -> InferenceEndpoint:
        return InferenceEndpoint(
            base_url=self.base_url,
            api_key="scripted-key",
            model_name=f"{model.project}/{model.name}",
            supports_token_ids=False,
        )

    async def get_step(self, model: art.TrainableModel) -> int:
        return self.steps[-1] if self.steps else 0

    async def checkpoint_steps(self, model: art.TrainableModel) -> list[int]:
        return list(self.steps)

    async def serve_step(self, model: art.TrainableModel, step: int) -> str:
        self.served.append(step)
        return f"{model.project}/{model.name}@{step}"


def question_of(request: dict[str, Any]) -> dict[str, Any]:
    text = request["messages"][-1]["content"]
    return next(q for q in QUESTIONS if q["question"] == text)


def grader(trained_step: int, delay_s: float = 0.0):
    """A responder: steps below `trained_step` answer BASE_RIGHT right, later steps also IMPROVED; every step answers
    COIN right exactly when the seed is even; everything else wrong. "reference-model" answers all right."""

    def respond(request: dict[str, Any]) -> Reply:
        if delay_s:
            time.sleep(delay_s)
        question = question_of(request)
        model, qid = request["model"], question["id"]
        prefix = f"{PROJECT}/{NAME}@"
        if model == "reference-model":
            right = True
        elif model.startswith(prefix) and model[len(prefix) :].isdigit():
            right = qid in (
                BASE_RIGHT | IMPROVED if int(model[len(prefix) :]) >= trained_step else BASE_RIGHT
            )
        else:
            raise AssertionError(f"unexpected model {model!r}")
        if qid == COIN:
            right = request.get("seed", 1) % 2 == 0
        return Reply(content=question["answer"] if right else "no idea")

    return respond


async def rollout(model: art.Model, scenario: dict[str, Any]) -> art.Trajectory:
    """An ART rollout, as a user writes it."""
    client = model.openai_client()
    messages = [{"role": "user", "content": scenario["question"]}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, temperature=1.0, max_tokens=64
    )
    choice = completion.choices[0]
    reward = 1.0 if choice.message.content == scenario["answer"] else 0.0
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)
