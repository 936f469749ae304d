"""Runs one framework's group of rollouts in that framework's environment and writes what was captured.

    python tests/matrix/run.py FRAMEWORK --base-url URL --api-key KEY --model NAME --rollouts N --out FILE
        [--per-agent '{"by": "agent", "agents": [...], "served": [...]}']

In-process capture (`wrap_rollout`, the adapters' hook) unless the framework's ROUTE is "endpoint" (its requests
then go to an `art.RecordingEndpoint` URL per rollout). With --per-agent the model is a per-agent TrainableModel
(`art.PerAgent(by, agents)`) whose routing holds the adapters the test's backend serves (`served`), as the backend
sets it after registering: capture then sends each call to its agent's adapter. Writes JSON: the versions of the
framework's packages, each rollout's trajectory (or its error), and the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import traceback
from importlib import metadata
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2] / "src")]

from common import Endpoint  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.openai import wrap_rollout  # noqa: E402


async def main() -> tuple[str, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-agent", default=None, help="JSON: by, agents, served (adapter names)")
    args = parser.parse_args()
    module = importlib.import_module(f"frameworks.{args.framework}")
    route = getattr(module, "ROUTE", "in-process")
    model = model_of(args)
    answers: list[str | None] = [None] * args.rollouts
    errors: list[str | None] = [None] * args.rollouts

    async def one(k: int) -> art.Trajectory:
        try:
            if route == "endpoint":
                routing = model.agent_routing()
                with art.RecordingEndpoint(args.base_url, args.api_key, routing=routing) as endpoint:
                    async with art.capture() as trajectory:
                        answers[k] = await module.rollout(Endpoint(endpoint.url(), "none", args.model), k)
                return trajectory

            async def run() -> None:
                answers[k] = await module.rollout(Endpoint(args.base_url, args.api_key, args.model), k)

            return await wrap_rollout(model, run, request_token_ids=True)()
        except Exception:
            errors[k] = traceback.format_exc()
            return art.Trajectory(messages_and_choices=[])

    trajectories = await asyncio.gather(*(one(k) for k in range(args.rollouts)))
    versions = {name: metadata.version(name) for name in module.PACKAGES}
    out = {
        "versions": versions,
        "route": route,
        "answers": answers,
        "errors": errors,
        "trajectories": [t.model_dump(mode="json") for t in trajectories],
    }
    return args.out, out


def model_of(args: argparse.Namespace) -> art.Model:
    """The model the rollouts call: the test's registered model, seen from this process."""
    if args.per_agent is None:
        return art.Model(
            name="matrix",
            inference_base_url=args.base_url,
            inference_api_key=args.api_key,
            inference_model_name=args.model,
        )
    per_agent = json.loads(args.per_agent)
    project, _, name = args.model.partition("/")
    model = art.TrainableModel(
        name=name,
        project=project,
        base_model="matrix",  # never loaded here: this process only captures
        adapters=art.PerAgent(by=per_agent["by"], agents=per_agent["agents"]),
        inference_base_url=args.base_url,
        inference_api_key=args.api_key,
        inference_model_name=args.model,
    )
    model.route_agents(args.model, per_agent["served"])
    return model


if __name__ == "__main__":
    path, result = asyncio.run(main())
    Path(path).write_text(json.dumps(result))
