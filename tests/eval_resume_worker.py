"""Run as a script by test_eval_harness_resume.py: evaluate against a scripted server with a resume file (it is
killed midway). Arguments: BASE_URL RESUME_FILE."""

from __future__ import annotations

import asyncio
import sys

import art_adapters as art
from eval_fakes import NAME, PROJECT, QUESTIONS, StepServingBackend, rollout


async def main(base_url: str, resume: str) -> None:
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
    await model.register(StepServingBackend(base_url, (0, 3)))  # type: ignore[arg-type]
    await art.evaluate(model, rollout, QUESTIONS, attempts=3, resume=resume, max_concurrent=2, progress=False)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
