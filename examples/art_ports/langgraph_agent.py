"""A LangGraph ReAct agent trained the way ART's LangGraph integration does it: `init_chat_model(...)` inside the
rollout, `wrap_rollout(model, rollout)` around it, `backend.train(...)` and `model.log(...)` after each gather.

Written as an ART user writes it; porting changed only `from art.langgraph import ...` ->
`from art_adapters.langgraph import ...` (and the base model and sizes).

python examples/art_ports/langgraph_agent.py --base-model Qwen/Qwen2.5-1.5B-Instruct --steps 10
"""

from __future__ import annotations

import argparse
import asyncio

from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

import art_adapters as art
from art_adapters.langgraph import init_chat_model, wrap_rollout
from art_adapters.local import LocalBackend

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima"}


@tool
def capital_of(country: str) -> str:
    """The capital city of a country."""
    return CAPITALS.get(country, "unknown")


async def rollout(model: art.TrainableModel, country: str) -> art.Trajectory:
    trajectory = art.Trajectory(messages_and_choices=[], reward=0.0, metadata={"country": country})
    chat_model = init_chat_model(model.name, temperature=1.0, max_tokens=24)
    agent = create_react_agent(chat_model, [capital_of])
    result = await agent.ainvoke(
        {"messages": [{"role": "user", "content": f"What is the capital of {country}?"}]},
        config={"recursion_limit": 6},
    )
    answer = str(result["messages"][-1].content)
    # The right city wins; shorter answers win ties (so equally wrong rollouts still differ).
    trajectory.reward = float(CAPITALS[country] in answer) - 0.01 * len(answer)
    return trajectory


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args(argv)

    model = art.TrainableModel(name="capitals-001", project="langgraph", base_model=args.base_model)
    backend = LocalBackend(path=args.path)
    await model.register(backend)

    for _ in range(await model.get_step(), args.steps):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    wrap_rollout(model, rollout)(model, country) for _ in range(args.group_size)
                )
                for country in CAPITALS
            ),
            pbar_desc="gather",
        )
        result = await backend.train(model, groups, learning_rate=1e-4)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        calls = sum(len(t.llm_calls) for g in groups for t in g)
        print(
            f"step {result.step}: llm calls {calls} trained_tokens {result.metrics.get('trained_tokens', 0):.0f}"
        )
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
