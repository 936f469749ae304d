"""Token-exact capture and training on Qwen's real vocabulary and chat formats (tiny qwen2.5 and qwen3 models).

One vLLM server per family (hermes tool parser; Qwen3 with its reasoning parser). Multi-turn tool agents: a plain
OpenAI loop with parallel tool calls, LangGraph's `create_agent` streaming, a malformed tool call, Qwen3 with
thinking on and off. The models are random, so each turn's text is forced with a structured-output `choice` and a
logit bias towards its canonical tokens (as in test_adapters_vllm.py); the engine still samples every token.

Per rollout: trained ids == sampled ids, 100 % (F1). Per family, at the end: the chaining rate and the extra
context tokens of unchained calls (the doctor names each cause), and one GRPO step on these rollouts after which
vLLM's logprobs of the new adapter equal the trainer's (F2, <= 1e-4).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

import art_adapters as art
from art_adapters.cli import main
from art_adapters.doctor import diagnose
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.openai import run_tool_loop
from art_adapters.openai import wrap_rollout as openai_rollout
from art_adapters.testing import steer
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import tokenize_trajectory
from fixtures_vllm import registered_on

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ROLL = {
    "type": "function",
    "function": {
        "name": "roll",
        "description": "Roll a die.",
        "parameters": {"type": "object", "properties": {}},
    },
}
CALL = '<tool_call>\n{"name": "roll", "arguments": {}}\n</tool_call>'
TWO_CALLS = f"{CALL}\n{CALL}"  # Qwen's templates join parallel calls with "\n"
NULL_CALL = '<tool_call>\n{"name": "roll", "arguments": null}\n</tool_call>'
ANSWER = "You rolled 4 and 4."
THINK = "<think>\nRoll the die twice.\n</think>\n\n"
RUNS: dict[str, list[art.Trajectory]] = {}  # every rollout of this module, by family, for the totals
SWAP_TOLERANCE = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["qwen2.5", "qwen3"])
async def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, VLLMServer, Any]]:
    from transformers import AutoTokenizer

    name = request.param
    path = tiny_model_path(name)
    log = tmp_path_factory.mktemp(f"vllm-{name}") / "vllm.log"
    config = InferenceConfig(max_lora_rank=8, max_loras=2, structured_outputs_in_reasoning=True)
    server = VLLMServer(path, config, log_path=log)
    await server.start()
    print(f"\n[vllm {name}] start-up {server.startup_s:.1f} s, log {log}")
    RUNS[name] = []
    try:
        yield name, server, AutoTokenizer.from_pretrained(path)
    finally:
        await server.stop()


def art_model(server: VLLMServer) -> art.Model:
    return art.Model(
        name="agent",
        inference_base_url=server.base_url,
        inference_api_key=server.api_key,
        inference_model_name=server.model_name,
    )


def client_of(server: VLLMServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)


def assert_trained_is_sampled(trajectory: art.Trajectory, tok: Any) -> int:
    """F1: the trained tokens (mask 1) are exactly every call's sampled tokens. Returns how many sequences."""
    out = tokenize_trajectory(trajectory, tok, max_seq_len=4096)
    assert not out.skipped and out.too_long == 0, out.reason
    trained = [t for s in out.sequences for t, m in zip(s.input_ids, s.trained_mask, strict=True) if m]
    assert trained == [t for c in trajectory.llm_calls for t in c.completion_token_ids or []]
    for call in trajectory.llm_calls:
        assert call.error is None and call.prompt_token_ids and call.completion_token_ids
        assert len(call.logprobs or []) == len(call.completion_token_ids)
    return len(out.sequences)


def chained(trajectory: art.Trajectory) -> list[bool]:
    calls = trajectory.llm_calls
    out = []
    for prev, call in zip(calls, calls[1:], strict=False):
        done = (prev.prompt_token_ids or []) + (prev.completion_token_ids or [])
        out.append((call.prompt_token_ids or [])[: len(done)] == done)
    return out


async def test_openai_loop_parallel_tool_calls(family: tuple[str, VLLMServer, Any]) -> None:
    """A hand-written OpenAI tool loop; two calls in one turn, then the answer. Qwen3 thinks first; its reasoning
    goes back as `reasoning`, which Qwen3's template keeps after the last user query: the turns chain."""
    name, server, tok = family
    think = THINK if name == "qwen3" else ""

    @openai_rollout(art_model(server), request_token_ids=True)
    async def rollout() -> float:
        client = client_of(server)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Roll a die twice."}]
        for text in (think + TWO_CALLS, think + ANSWER):
            response = await client.chat.completions.create(
                model=server.model_name,
                messages=messages,  # type: ignore[arg-type]
                tools=[ROLL],  # type: ignore[list-item]
                max_tokens=64,
                temperature=1.0,
                extra_body=steer(tok, text),
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            if name == "qwen3":
                assert (message.model_extra or {}).get("reasoning", "").strip() == "Roll the die twice."
                messages[-1]["reasoning"] = message.model_extra["reasoning"]  # type: ignore[index]
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "4"})
        assert messages[-1]["content"].strip() == ANSWER  # Qwen3: vLLM keeps the "\n\n" after </think>
        return 1.0

    trajectory = await rollout()
    first = trajectory.llm_calls[0].response["choices"][0]["message"]  # type: ignore[index]
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["roll", "roll"]
    assert assert_trained_is_sampled(trajectory, tok) == 1 and chained(trajectory) == [True]
    if name == "qwen3":  # the <think> tokens it sampled are trained
        think_id = tok.convert_tokens_to_ids("<think>")
        assert all(think_id in (c.completion_token_ids or []) for c in trajectory.llm_calls)
    RUNS[name].append(trajectory)


async def test_langgraph_create_agent_streaming(family: tuple[str, VLLMServer, Any]) -> None:
    """`create_agent` on a streaming ChatOpenAI; a middleware steers each model call (tool call, then answer)."""
    pytest.importorskip("langchain")
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    from art_adapters.langgraph import wrap_rollout

    name, server, tok = family
    think = THINK if name == "qwen3" else ""

    @tool("roll")
    def roll_tool() -> str:
        """Roll a die."""
        return "4"

    @wrap_model_call
    async def steered(request: Any, handler: Any) -> Any:
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        text = think + ("You rolled 4." if answered else CALL)
        return await handler(request.override(model_settings={"extra_body": steer(tok, text)}))

    llm = ChatOpenAI(
        base_url=server.base_url,
        api_key=server.api_key,  # type: ignore[arg-type]
        model=server.model_name,
        temperature=1.0,
        max_tokens=48,
        max_retries=0,
        streaming=True,
    )
    agent = create_agent(model=llm, tools=[roll_tool], middleware=[steered])

    @wrap_rollout(art_model(server), request_token_ids=True)
    async def rollout() -> float:
        result = await agent.ainvoke({"messages": [{"role": "user", "content": "Roll."}]})
        assert [m.type for m in result["messages"]] == ["human", "ai", "tool", "ai"]
        return 0.0

    trajectory = await rollout()
    assert all(call.stream for call in trajectory.llm_calls) and len(trajectory.llm_calls) == 2
    assert assert_trained_is_sampled(trajectory, tok) >= 1
    # Qwen3 thinks by default; LangChain does not send the reasoning back, so its template strips it and the
    # second prompt starts a new sequence (still exact). Qwen2.5 has nothing to strip: one sequence.
    assert chained(trajectory) == [name == "qwen2.5"]
    RUNS[name].append(trajectory)


async def roll_twice(server: VLLMServer, extra_body: dict[str, Any]) -> Any:
    """Our `run_tool_loop`, two turns of "Roll a die." with the `roll` tool, each request steered by `extra_body`."""
    return await run_tool_loop(
        client_of(server),
        server.model_name,
        [{"role": "user", "content": "Roll a die."}],
        [ROLL],
        {"roll": lambda: "4"},
        max_turns=2,
        max_tokens=32,
        temperature=1.0,
        extra_body=extra_body,
    )


async def test_malformed_tool_call_goes_back_as_an_error(family: tuple[str, VLLMServer, Any]) -> None:
    """`"arguments": null` twice: the loop answers with an error message; vLLM renders the call back as `{}`."""
    name, server, tok = family
    think = THINK if name == "qwen3" else ""  # the loop sends Qwen3's reasoning back: only the call breaks

    @openai_rollout(art_model(server), request_token_ids=True)
    async def rollout() -> float:
        result = await roll_twice(server, steer(tok, think + NULL_CALL))
        assert result.tool_errors == 2
        assert result.messages[2]["content"].startswith("Error: arguments must be a JSON object")
        return 0.0

    trajectory = await rollout()
    assert assert_trained_is_sampled(trajectory, tok) == 2 and chained(trajectory) == [False]
    RUNS[name].append(trajectory)


async def test_qwen3_thinking_off(family: tuple[str, VLLMServer, Any]) -> None:
    """`enable_thinking=False` pre-fills an empty <think> block that history never renders back: no chaining."""
    name, server, tok = family
    if name != "qwen3":
        pytest.skip("a Qwen3 setting")

    @openai_rollout(art_model(server), request_token_ids=True)
    async def rollout() -> float:
        result = await roll_twice(
            server, {**steer(tok, CALL), "chat_template_kwargs": {"enable_thinking": False}}
        )
        assert result.tool_calls == 2 and result.tool_errors == 0
        return 1.0

    trajectory = await rollout()
    first = trajectory.llm_calls[0]
    assert first.response["choices"][0]["message"].get("reasoning") is None  # type: ignore[index]
    assert tok.decode(first.prompt_token_ids[-6:]).endswith("<think>\n\n</think>\n\n")
    assert assert_trained_is_sampled(trajectory, tok) == 2 and chained(trajectory) == [False]
    RUNS[name].append(trajectory)


async def test_chaining_rate_doctor_and_swap(
    family: tuple[str, VLLMServer, Any],
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The family's totals; every unchained call explained; one GRPO step, then vLLM == trainer (F2)."""
    name, server, tok = family
    runs = RUNS[name]
    assert len(runs) == (4 if name == "qwen3" else 3)
    report = diagnose(runs, tok)
    assert all(c.template_matches for c in report.calls)  # the engine's prompts are our templates' renderings
    unchained = [c for c in report.calls if c.chained is False]
    expected = {"qwen2.5": ["arguments"], "qwen3": ["reasoning", "arguments", "reasoning"]}[name]
    assert [c.causes[0] for c in unchained] == expected
    summary = report.summary()
    print(f"\n[fidelity {name}] {json.dumps(summary)}")
    assert summary["extra_context_tokens"] > 0

    async with registered_on(
        server, tmp_path_factory.mktemp("art"), name=f"fid-{name}", project="fid"
    ) as pair:
        backend, model = pair
        for k, trajectory in enumerate(runs):
            trajectory.reward = float(k % 2)
        group = art.TrajectoryGroup(runs)
        metrics = await model.train([group], config=art.TrainConfig(learning_rate=1e-3))
        sampled = sum(len(c.completion_token_ids or []) for t in runs for c in t.llm_calls)
        assert metrics["trained_tokens"] == sampled and metrics["skipped_groups"] == 0
        call = runs[0].llm_calls[-1]
        ids = list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])
        assert await backend.served_logprob_diff(model, ids, await model.get_step()) <= SWAP_TOLERANCE
        # The doctor on the backend's own folder (the step recorded its trajectories), as a user runs it.
        folder = backend.model_dir(model) / "trajectories"
        capsys.readouterr()
        assert main(["doctor", str(folder), "--model", str(server.base_model), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["summary"] == summary
