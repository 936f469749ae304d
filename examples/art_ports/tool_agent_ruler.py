"""A tool-calling support agent scored by RULER, trained the way ART >= 0.5.18 scripts train:
`ruler_score_group(group, "hosted_vllm/...")` in `after_each`, then `result = await backend.train(model, groups, ...)`
and `await model.log(groups, metrics=result.metrics, step=result.step, split="train")`.

Written as an ART user writes it; porting changed only the imports (and the base model and sizes). The judge is
any LiteLLM model string; by default the policy's own server judges (with guided JSON), so the script runs offline.

python examples/art_ports/tool_agent_ruler.py --base-model Qwen/Qwen2.5-1.5B-Instruct --judge openai/o4-mini
"""

from __future__ import annotations

import argparse
import asyncio
import json

import art_adapters as art
from art_adapters.local import LocalBackend
from art_adapters.rewards import ruler_score_group

ORDERS = {"A1": "shipped", "B2": "delayed", "C3": "delivered"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "order_status",
            "description": "Look up the status of an order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]
SYSTEM = "You are a support agent. Use the order_status tool, then tell the customer the status."


def order_status(order_id: str) -> str:
    return ORDERS.get(order_id, f"no order {order_id!r}")


async def rollout(model: art.TrainableModel, order_id: str, max_turns: int = 2) -> art.Trajectory:
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Where is my order {order_id}?"},
        ],
        tools=TOOLS,
    )
    for _ in range(max_turns):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            tools=TOOLS,
            max_tokens=24,
            temperature=1.0,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            try:
                result = order_status(**json.loads(call.function.arguments))
            except Exception as error:  # a malformed call is an error message to the agent
                result = f"error: {error}"
            trajectory.messages_and_choices.append(
                {"role": "tool", "tool_call_id": call.id, "content": result}
            )
    answer = trajectory.messages()[-1].get("content") or ""
    trajectory.reward = float(
        ORDERS[order_id] in answer
    )  # RULER replaces it; kept as metrics["independent_reward"]
    return trajectory


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument(
        "--judge", default=None, help="LiteLLM model string (default: the policy's own server)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args(argv)

    model = art.TrainableModel(name="support-001", project="support", base_model=args.base_model)
    backend = LocalBackend(path=args.path)
    await model.register(backend)
    judge = args.judge or f"hosted_vllm/{model.get_inference_name()}"
    # The offline default judge is the untrained policy: its verdicts are noise, sampled (temperature 1) so that
    # scores differ and the loop trains; with a real judge (--judge) RULER judges greedily.
    judge_params = (
        {}
        if args.judge
        else {"api_base": model.inference_base_url, "api_key": model.inference_api_key, "temperature": 1.0}
    )
    # art-adapters' bound for small judges (guided decoding keeps each explanation short); ART has no such knob.
    small_judge = {} if args.judge else {"max_explanation_chars": 40, "ordered_ids": True}

    for _ in range(await model.get_step(), args.steps):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, order) for _ in range(args.group_size)) for order in ORDERS),
            after_each=lambda group: ruler_score_group(
                group,
                judge,
                {**judge_params, "max_tokens": 400},
                rubric="Prefer answers that call the tool and then state the order's status.",
                swallow_exceptions=True,  # a group the judge cannot score is dropped
                **small_judge,
            ),
            pbar_desc="gather",
        )
        result = await backend.train(model, groups, learning_rate=1e-4)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        print(
            f"step {result.step}: judged groups {len(groups)} "
            f"trained_tokens {result.metrics.get('trained_tokens', 0):.0f} loss {result.metrics.get('loss', 0):.4f}"
        )
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
