"""Train the ordinary LangGraph SQL agent with RL: the only change to the agent is `@wrap_rollout(model)`.

python examples/langgraph_sql_agent/train.py --base-model Qwen/Qwen2.5-3B-Instruct --steps 50   # GPU recipe
python examples/langgraph_sql_agent/train.py --endpoint http://127.0.0.1:8000/v1 --steps 1      # rollouts only
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import build_agent  # noqa: E402
from langgraph.errors import GraphRecursionError  # noqa: E402

import art_adapters as art  # noqa: E402
from art_adapters.envs import Scenario, SQLiteEnv  # noqa: E402
from art_adapters.langgraph import wrap_rollout  # noqa: E402
from art_adapters.trajectories import write_jsonl  # noqa: E402


async def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-model", default="Qwen/Qwen2.5-3B-Instruct", help="model to train (LocalBackend)"
    )
    parser.add_argument(
        "--endpoint", help="rollouts only, against this OpenAI-compatible base URL (no training)"
    )
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model-name", default="sql-agent")
    parser.add_argument("--db", default=None, help="database file (generated if missing)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--scenarios", type=int, default=4, help="scenarios per step")
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=12, help="graph recursion limit per rollout")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--path", default=".art")
    parser.add_argument("--out", help="write the last step's trajectories to this JSONL file")
    parser.add_argument(
        "--request-token-ids", action="store_true", help="ask the endpoint for token ids (vLLM)"
    )
    args = parser.parse_args(argv)

    env = SQLiteEnv(args.db)
    if args.endpoint:
        model: art.Model = art.Model(
            name=args.model_name, inference_base_url=args.endpoint, inference_api_key=args.api_key
        )
    else:
        model = art.TrainableModel(name=args.model_name, project="sql-agent", base_model=args.base_model)
        await model.register(art.LocalBackend(args.path))
    assert model.inference_base_url is not None
    agent = build_agent(
        model.inference_base_url, model.inference_api_key or "none", model.get_inference_name(), env
    )

    @wrap_rollout(model, request_token_ids=True if args.request_token_ids else None)
    async def rollout(scenario: Scenario) -> float:
        messages = [
            {"role": "system", "content": env.system_prompt()},
            {"role": "user", "content": scenario.question},
        ]
        try:
            state = await agent.ainvoke({"messages": messages}, {"recursion_limit": args.max_steps})
        except GraphRecursionError:
            return 0.0
        answer = str(state["messages"][-1].content)
        # The exact answer: 1; among wrong ones, shorter answers (the ANSWER line only) win ties.
        return env.reward(scenario, answer) or -min(len(answer), 200) / 2000

    train = env.scenarios("train")
    rewards: list[float] = []
    for step in range(args.steps):
        batch = [train[(step * args.scenarios + i) % len(train)] for i in range(args.scenarios)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(s) for _ in range(args.group_size)) for s in batch),
            pbar_desc=f"step {step}",
        )
        trajectories = [t for g in groups for t in g]
        mean = sum(t.reward for t in trajectories) / max(len(trajectories), 1)
        calls = sum(len(t.llm_calls) for t in trajectories)
        rewards.append(mean)
        if args.out:
            write_jsonl(args.out, trajectories)
        line = f"step {step}: reward {mean:.3f} over {len(trajectories)} rollouts, {calls} LLM calls"
        if isinstance(model, art.TrainableModel):
            metrics = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
            line += f", trained_tokens {metrics['trained_tokens']}"
        print(line, flush=True)
    return rewards


if __name__ == "__main__":
    asyncio.run(main())
