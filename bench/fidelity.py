"""Token fidelity per tokenizer family: chaining rate, trained / sampled tokens, extra context, swap Δlogprob.

For each tiny model (byte, qwen2.5, qwen3) one vLLM server runs multi-turn tool agents: a plain OpenAI loop that
sends each turn back as vLLM returned it (Qwen3's `reasoning` included), LangGraph's `create_agent` streaming (which
drops reasoning), and on Qwen3 a loop with thinking off. The random models' text is forced (structured-output choice +
canonical-token bias), so the figures measure what chat formats and clients do to token sequences, not model quality.
Then one GRPO step on the rollouts, and vLLM's logprobs of the new adapter against the trainer's.

chaining rate: calls that continue an earlier call's sequence token for token / calls with history.
trained / sampled: tokens trained (mask 1) that the engine sampled / tokens sampled (must be 1.000).
extra context: tokens re-fed per unchained call (the conversation restarts as a new sequence).
Usage: python bench/fidelity.py [--families byte,qwen2.5,qwen3] [--rollouts 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

THINK = "<think>\nRoll the die twice.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "roll", "arguments": {}}\n</tool_call>'
ROLL = {
    "type": "function",
    "function": {
        "name": "roll",
        "description": "Roll a die.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def endpoint(server: Any) -> Any:
    import art_adapters as art

    return art.Model(
        name="agent",
        inference_base_url=server.base_url,
        inference_api_key=server.api_key,
        inference_model_name=server.model_name,
    )


async def openai_loop(server: Any, tok: Any, think: str, thinking: bool = True) -> Any:
    import openai

    from art_adapters.openai import wrap_rollout
    from art_adapters.testing import steer

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    extra = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}

    @wrap_rollout(endpoint(server), request_token_ids=True)
    async def rollout() -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Roll a die twice."}]
        for text in (think + f"{CALL}\n{CALL}", think + "You rolled 4 and 4."):
            response = await client.chat.completions.create(
                model=server.model_name,
                messages=messages,  # type: ignore[arg-type]
                tools=[ROLL],  # type: ignore[list-item]
                max_tokens=64,
                temperature=1.0,
                extra_body={**steer(tok, text), **extra},
            )
            message = response.choices[0].message
            turn = message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            if (message.model_extra or {}).get("reasoning"):
                turn["reasoning"] = message.model_extra["reasoning"]  # type: ignore[index]
            messages.append(turn)
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": "4"} for c in message.tool_calls or []
            ]
        return 0.0

    return await rollout()


async def langgraph_agent(server: Any, tok: Any, think: str) -> Any:
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    from art_adapters.langgraph import wrap_rollout
    from art_adapters.testing import steer

    @tool("roll")
    def roll() -> str:
        """Roll a die."""
        return "4"

    @wrap_model_call
    async def steered(request: Any, handler: Any) -> Any:
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        text = think + ("You rolled 4." if answered else CALL)
        return await handler(request.override(model_settings={"extra_body": steer(tok, text)}))

    llm = ChatOpenAI(
        base_url=server.base_url,
        api_key=server.api_key,
        model=server.model_name,
        temperature=1.0,
        max_tokens=64,
        max_retries=0,
        streaming=True,
    )
    agent = create_agent(model=llm, tools=[roll], middleware=[steered])

    @wrap_rollout(endpoint(server), request_token_ids=True)
    async def rollout() -> float:
        await agent.ainvoke({"messages": [{"role": "user", "content": "Roll."}]})
        return 0.0

    return await rollout()


def exactness(trajectories: list[Any], tok: Any) -> tuple[int, int]:
    """(sampled tokens, trained tokens that are the sampled ones, position for position)."""
    from art_adapters.training.tokenize import tokenize_trajectory

    sampled = trained = 0
    for trajectory in trajectories:
        ids = [t for c in trajectory.llm_calls for t in c.completion_token_ids or []]
        out = tokenize_trajectory(trajectory, tok, max_seq_len=4096)
        got = [t for s in out.sequences for t, m in zip(s.input_ids, s.trained_mask, strict=True) if m]
        sampled += len(ids)
        trained += sum(a == b for a, b in zip(got, ids, strict=False)) if len(got) == len(ids) else 0
    return sampled, trained


async def bench_family(family: str, rollouts: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    import art_adapters as art
    from art_adapters.doctor import diagnose
    from art_adapters.inference import InferenceConfig, VLLMServer
    from art_adapters.tiny import tiny_model_path

    path = tiny_model_path(family)
    tok = AutoTokenizer.from_pretrained(path)
    config = InferenceConfig(max_lora_rank=8, max_loras=2, structured_outputs_in_reasoning=True)
    root = Path(tempfile.mkdtemp(prefix=f"fidelity-{family}-"))
    server = VLLMServer(path, config, log_path=root / "vllm.log")
    await server.start()
    think = THINK if family == "qwen3" else ""
    styles: dict[str, Any] = {
        "OpenAI loop, turns sent back as returned": lambda: openai_loop(server, tok, think),
        "LangGraph create_agent, streaming": lambda: langgraph_agent(server, tok, think),
    }
    if family == "qwen3":
        styles["OpenAI loop, enable_thinking=False"] = lambda: openai_loop(server, tok, "", thinking=False)
    rows, everything = [], []
    try:
        for style, run in styles.items():
            trajectories = [await run() for _ in range(rollouts)]
            everything += trajectories
            summary = diagnose(trajectories, tok).summary()
            sampled, trained = exactness(trajectories, tok)
            unchained = summary["continuing_calls"] - summary["chained"]
            rows.append(
                {
                    "family": family,
                    "agent": style,
                    "chaining": f"{summary['chained']}/{summary['continuing_calls']}",
                    "rate": summary["chaining_rate"],
                    "exact": trained / max(sampled, 1),
                    "extra": summary["extra_context_tokens"] / max(unchained, 1) if unchained else 0.0,
                    "causes": ", ".join(f"{k} {v}" for k, v in summary["causes"].items()) or "-",
                }
            )
        backend = art.LocalBackend(root / "art").use_server(server)
        model = art.TrainableModel(
            name="fid", project="bench", base_model=str(path), lora=art.LoRAConfig(rank=8)
        )
        await model.register(backend)
        for k, trajectory in enumerate(everything):
            trajectory.reward = float(k % 2)
        await model.train([art.TrajectoryGroup(everything)], config=art.TrainConfig(learning_rate=1e-3))
        call = everything[0].llm_calls[-1]
        ids = list(call.prompt_token_ids) + list(call.completion_token_ids)
        delta = await backend.served_logprob_diff(model, ids, await model.get_step())
        await backend.close()
        for row in rows:
            row["swap"] = delta
    finally:
        await server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="byte,qwen2.5,qwen3")
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts per agent style")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    rows = []
    for family in args.families.split(","):
        rows += asyncio.run(bench_family(family, args.rollouts))
    print("| family | agent | chained | chaining rate | trained / sampled | extra context / unchained call "
          "| causes | swap Δlogprob |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['agent']} | {r['chaining']} | {r['rate']:.3f} | {r['exact']:.3f} "
            f"| {r['extra']:.0f} | {r['causes']} | {r['swap']:.1e} |"
        )


if __name__ == "__main__":
    main()
