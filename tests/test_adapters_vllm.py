"""The three adapters against the real vLLM server on the tiny model: multi-turn tool agents, trained ids == sampled.

Each agent builds its own client on the server (nothing of ours but the decorator) and runs a real tool exchange:
a tool call, the tool's result back, a second call whose prompt extends the first. The tiny model is random, so the
tool calls are forced, and a logit bias towards the call's canonical tokens makes the engine sample exactly the
tokens the chat template renders the call back as; the second prompt then extends the first token for token and
`tokenize_trajectory` continues one sequence (both completions trained, the tool result between them as context).

Forcing by `tool_choice` (named or "required") cannot get there: vLLM's forced-tool grammar leaves "arguments"
free (it does not follow the tool's schema) and no static bias steers it to `{}` (" " and ' "' compete at the tool
name and at the arguments), while any non-object arguments are rendered back as `{}` by vLLM. So the continuing
tests force the hermes text with a structured-output `choice` under `tool_choice="auto"` (vLLM's hermes parser turns
it into a real tool call); the named-tool_choice test takes the `null` arguments the grammar allows, the tool
loop's error path, and checks the other tokenizer path: the next prompt does not extend, a second sequence.

Checked per call: recorded in order, prompt ids, completion ids and one logprob per completion token, and the
server's prompt ids equal `apply_chat_template(request messages, tools=request tools)`. Per trajectory: the
concatenation of trained tokens (mask 1) equals that of every call's completion ids, logprobs likewise, 100 %.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import openai
import pytest

import art_adapters as art
from art_adapters.adapters.base import hook_installed
from art_adapters.inference import VLLMServer
from art_adapters.openai import run_tool_loop
from art_adapters.openai import wrap_rollout as openai_rollout
from art_adapters.training.tokenize import (
    TokenizedTrajectory,
    TrainSequence,
    chat_template_ids,
    tokenize_trajectory,
)
from fixtures_vllm import chat

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

MAX_TOKENS = 24  # a steered tool call is 17-19 tokens
EOS = "<|im_end|>"
ROLL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "roll",
        "description": "Roll a die.",
        "parameters": {"type": "object", "properties": {}},
    },
}
NAMED_ROLL = {"type": "function", "function": {"name": "roll"}}
# vLLM's forced-tool grammar (named or "required", non-strict tool) leaves "arguments" free of the schema; `null` is
# the value whose canonical tokens a static bias can steer to (" n" loses nowhere else in the grammar).
NULL_CALL = '<tool_call>\n{"name": "roll", "arguments": null}\n</tool_call>'
EMPTY_CALL = '<tool_call>\n{"name": "roll", "arguments": {}}\n</tool_call>'


def roll() -> str:
    return "4"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def canonical_bias(tokenizer: Any, text: str, prefer: tuple[str, ...] = ()) -> dict[str, int]:
    """A logit bias towards the canonical tokens of `text` + EOS, longer tokens first (`prefer`red ones top)."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids(EOS)]
    bias = {}
    for token in ids:
        piece = tokenizer.decode([token])
        bias[str(token)] = 100 if piece in prefer else min(90, 40 + 5 * len(piece))
    return bias


def art_model(server: VLLMServer) -> art.Model:
    return art.Model(
        name="agent",
        inference_base_url=server.base_url,
        inference_api_key=server.api_key,
        inference_model_name=server.model_name,
    )


def steering(tokenizer: Any) -> dict[str, Any]:
    """Request options forcing the hermes text of a `roll` call, sampled as its canonical tokens."""
    return {
        "structured_outputs": {"choice": [EMPTY_CALL]},
        "logit_bias": canonical_bias(tokenizer, EMPTY_CALL),
    }


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM renders them: tool-call arguments parsed, anything but a JSON object coerced to `{}`
    (vllm/renderers/chat_utils.py, "if arguments is None or empty string, set to {}")."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                try:
                    args = json.loads(function.get("arguments") or "{}")
                except ValueError:
                    args = {}
                function["arguments"] = args if isinstance(args, dict) else {}
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def assert_calls(trajectory: art.Trajectory, tokenizer: Any, n: int) -> list[art.LLMCall]:
    """`n` calls recorded in order, each with the server's prompt ids (= the chat template's), ids and logprobs."""
    calls = trajectory.llm_calls
    assert len(calls) == n, [c.request["messages"][-1] for c in calls]
    assert [c.started_at for c in calls] == sorted(c.started_at for c in calls)
    for k, call in enumerate(calls):
        assert call.error is None and call.status_code == 200, call.error
        assert call.request.get("return_token_ids") is True and call.request.get("logprobs") is True
        assert call.prompt_token_ids, f"call {k}: no prompt ids"
        assert call.completion_token_ids, f"call {k}: no completion ids"
        assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in call.logprobs)
        assert call.response
        if call.response.get("usage"):  # a stream has usage only when the client asks for it
            assert call.response["usage"]["completion_tokens"] == len(call.completion_token_ids)
        messages, tools = call.request["messages"], call.request.get("tools")
        assert call.prompt_token_ids == prompt_ids(tokenizer, vllm_messages(messages), tools), f"call {k}"
        if messages == vllm_messages(messages):  # arguments that are JSON objects: the request as it is
            assert call.prompt_token_ids == prompt_ids(tokenizer, messages, tools), f"call {k}"
    for k, call in enumerate(calls[1:], 1):  # each call sees the previous one's tool result
        assert call.request["messages"][-1]["role"] == "tool", f"call {k}"
    assert not trajectory.additional_histories and not hook_installed()
    return calls


def spans(sequence: TrainSequence) -> list[tuple[int, int]]:
    """The [start, end) runs of trained tokens."""
    out: list[tuple[int, int]] = []
    for i, m in enumerate(sequence.trained_mask):
        if m and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif m:
            out.append((i, i + 1))
    return out


def trained_logprobs(call: art.LLMCall) -> list[float]:
    """What training keeps of a call's logprobs: steered calls (guided choice + logit_bias) sampled from a
    distribution the trainer does not reproduce, so their tokens train without an importance ratio (NaN)."""
    steered = "structured_outputs" in call.request or "logit_bias" in call.request
    return [math.nan] * len(call.logprobs or []) if steered else list(call.logprobs or [])


def same_floats(a: list[float], b: list[float]) -> bool:
    """Equal, NaN matching NaN."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def assert_trained_is_sampled(trajectory: art.Trajectory, tokenizer: Any) -> TokenizedTrajectory:
    """Tokenized for training, the trained tokens (mask 1) are every call's sampled tokens, logprobs likewise."""
    calls = trajectory.llm_calls
    out = tokenize_trajectory(trajectory, tokenizer, max_seq_len=2048)
    assert not out.skipped and out.too_long == 0, out.reason
    trained = [t for s in out.sequences for t, m in zip(s.input_ids, s.trained_mask, strict=True) if m]
    lps = [x for s in out.sequences for x, m in zip(s.sampled_logprobs, s.trained_mask, strict=True) if m]
    assert trained == [t for c in calls for t in c.completion_token_ids]
    expected = [x for c in calls for x in trained_logprobs(c)]
    assert same_floats(lps, expected)
    assert out.excluded_tokens == sum(math.isnan(b) for b in expected)
    for sequence in out.sequences:
        assert all(
            math.isnan(x)
            for x, m in zip(sequence.sampled_logprobs, sequence.trained_mask, strict=True)
            if not m
        )
    return out


def assert_one_sequence(trajectory: art.Trajectory, tokenizer: Any) -> TrainSequence:
    """The "continues the previous sequence" path: one sequence, one trained span per call, context between."""
    calls = trajectory.llm_calls
    for prev, call in zip(calls, calls[1:], strict=False):  # what the steering is for
        done = prev.prompt_token_ids + prev.completion_token_ids
        assert call.prompt_token_ids[: len(done)] == done, "the next prompt does not extend the call"
    out = assert_trained_is_sampled(trajectory, tokenizer)
    assert len(out.sequences) == 1
    (sequence,) = out.sequences
    trained = spans(sequence)
    assert len(trained) == len(calls) >= 2
    for (start, end), call in zip(trained, calls, strict=True):
        assert sequence.input_ids[:start] == call.prompt_token_ids
        assert sequence.input_ids[start:end] == call.completion_token_ids
        assert same_floats(sequence.sampled_logprobs[start:end], trained_logprobs(call))
    for (_, end), (start, _) in zip(trained, trained[1:], strict=False):
        assert start > end  # the tool result (and the template around it) as untrained context
    assert sequence.input_ids == calls[-1].prompt_token_ids + calls[-1].completion_token_ids
    return sequence


def tool_response(tokenizer: Any, sequence: TrainSequence, content: str) -> None:
    """The context between the first two trained spans holds the tool's result."""
    (_, end), (start, _) = spans(sequence)[:2]
    assert f"<tool_response>\n{content}\n</tool_response>" in tokenizer.decode(sequence.input_ids[end:start])


# ---- plain OpenAI tool loop ------------------------------------------------------------------------------------


async def test_openai_tool_loop_continues_one_sequence(vllm_server: VLLMServer, tokenizer: Any) -> None:
    @openai_rollout(art_model(vllm_server), request_token_ids=True)
    async def rollout() -> float:
        client = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key=vllm_server.api_key, max_retries=0)
        result = await run_tool_loop(
            client,
            vllm_server.model_name,
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Roll a die."}],
            [ROLL_SCHEMA],
            {"roll": roll},
            max_turns=2,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            extra_body=steering(tokenizer),
        )
        assert result.turns == 2 and result.tool_calls == 2 and result.tool_errors == 0
        return 1.0

    trajectory = await rollout()
    assert trajectory.reward == 1.0
    calls = assert_calls(trajectory, tokenizer, 2)
    for call in calls:
        choice = call.response["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "roll", "arguments": "{}"}
    assert calls[1].request["messages"][-1]["content"] == "4"
    assert [m["role"] for m in trajectory.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    tool_response(tokenizer, assert_one_sequence(trajectory, tokenizer), "4")


async def test_openai_tool_loop_named_tool_choice(vllm_server: VLLMServer, tokenizer: Any) -> None:
    """Forced by name: `"arguments": null` goes back as the loop's error message; vLLM renders it back as `{}`, so
    the second prompt does not extend the first and the tokenizer starts a second sequence (still 100 % trained)."""

    @openai_rollout(art_model(vllm_server), request_token_ids=True)
    async def rollout() -> float:
        client = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key=vllm_server.api_key, max_retries=0)
        result = await run_tool_loop(
            client,
            vllm_server.model_name,
            [{"role": "user", "content": "Roll a die."}],
            [ROLL_SCHEMA],
            {"roll": roll},
            max_turns=2,
            tool_choice=NAMED_ROLL,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            logit_bias=canonical_bias(tokenizer, NULL_CALL, prefer=(" n", "\n")),
        )
        assert result.turns == 2 and result.tool_calls == 2 and result.tool_errors == 2
        return 0.5

    trajectory = await rollout()
    assert trajectory.reward == 0.5
    calls = assert_calls(trajectory, tokenizer, 2)
    for call in calls:
        assert call.request["tool_choice"] == NAMED_ROLL
        assert call.response["choices"][0]["message"]["tool_calls"][0]["function"] == {
            "name": "roll",
            "arguments": "null",
        }
    assert calls[1].request["messages"][-1]["content"].startswith("Error: arguments must be a JSON object")
    out = assert_trained_is_sampled(trajectory, tokenizer)
    assert len(out.sequences) == 2
    for sequence, call in zip(out.sequences, calls, strict=True):
        assert sequence.input_ids == call.prompt_token_ids + call.completion_token_ids
        assert spans(sequence) == [(len(call.prompt_token_ids), len(sequence))]


# ---- LangGraph -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
async def test_langgraph_tool_agent_continues_one_sequence(
    vllm_server: VLLMServer, tokenizer: Any, streaming: bool
) -> None:
    """A hand-built StateGraph + ToolNode agent on its own ChatOpenAI: a forced tool call, then a free answer."""
    pytest.importorskip("langgraph")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from art_adapters.langgraph import wrap_rollout

    @tool("roll")
    def roll_tool() -> str:
        """Roll a die."""
        return roll()

    def build_agent() -> Any:
        llm = ChatOpenAI(
            base_url=vllm_server.base_url,
            api_key=vllm_server.api_key,
            model=vllm_server.model_name,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            max_retries=0,
            streaming=streaming,
        )
        first = llm.bind_tools([roll_tool], extra_body=steering(tokenizer))
        then = llm.bind_tools([roll_tool])

        async def agent(state: MessagesState) -> dict[str, Any]:
            answered = any(isinstance(m, ToolMessage) for m in state["messages"])
            return {"messages": [await (then if answered else first).ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", agent)
        graph.add_node("tools", ToolNode([roll_tool]))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        return graph.compile()

    @wrap_rollout(art_model(vllm_server), request_token_ids=True)
    async def rollout() -> float:
        result = await build_agent().ainvoke(
            {"messages": [HumanMessage("Roll a die.")]}, {"recursion_limit": 6}
        )
        assert [m.type for m in result["messages"]] == ["human", "ai", "tool", "ai"]
        assert result["messages"][2].content == "4"
        return 1.0

    trajectory = await rollout()
    calls = assert_calls(trajectory, tokenizer, 2)
    assert all(call.stream is streaming for call in calls)
    assert calls[0].response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "roll"
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    tool_response(tokenizer, assert_one_sequence(trajectory, tokenizer), "4")


# ---- OpenAI Agents SDK -----------------------------------------------------------------------------------------


async def test_openai_agents_runner_continues_one_sequence(vllm_server: VLLMServer, tokenizer: Any) -> None:
    """`Runner.run` on the agent's own OpenAIChatCompletionsModel; every turn a forced tool call, `max_turns=2`."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    from art_adapters.openai_agents import wrap_rollout

    set_tracing_disabled(True)
    # not strict: vLLM answers a strict tool (the SDK's default) under "auto" with its own tool-call grammar, which
    # replaces the request's structured output (and renders no newlines around the JSON, unlike the template)
    roll_tool = function_tool(
        roll, name_override="roll", description_override="Roll a die.", strict_mode=False
    )

    @wrap_rollout(art_model(vllm_server), request_token_ids=True)
    async def rollout() -> float:
        client = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key=vllm_server.api_key, max_retries=0)
        agent = Agent(
            name="roller",
            instructions="Roll a die.",
            tools=[roll_tool],
            model=OpenAIChatCompletionsModel(model=vllm_server.model_name, openai_client=client),
            model_settings=ModelSettings(
                temperature=1.0, max_tokens=MAX_TOKENS, extra_body=steering(tokenizer)
            ),
        )
        with pytest.raises(MaxTurnsExceeded):
            await Runner.run(agent, "Roll a die.", max_turns=2)
        return 0.0

    trajectory = await rollout()
    assert trajectory.reward == 0.0
    calls = assert_calls(trajectory, tokenizer, 2)
    assert calls[1].request["messages"][-1]["content"] == "4"
    assert [m["role"] for m in trajectory.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    tool_response(tokenizer, assert_one_sequence(trajectory, tokenizer), "4")


# ---- the tokenizer's own rendering of a context --------------------------------------------------------------


@pytest.mark.parametrize("arguments", ["null", '{"a":1}'], ids=["not-an-object", "compact-json"])
async def test_chat_template_ids_renders_tool_arguments_as_vllm(
    vllm_server: VLLMServer, tokenizer: Any, arguments: str
) -> None:
    """What `tokenize_trajectory` re-renders for a context without prompt ids must be what vLLM would have seen."""
    call = {"id": "c1", "type": "function", "function": {"name": "roll", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Roll a die."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    body = {"messages": messages, "tools": [ROLL_SCHEMA], "max_tokens": 1, "return_token_ids": True}
    served = (await chat(vllm_server, body))["prompt_token_ids"]
    assert served == prompt_ids(tokenizer, vllm_messages(messages), [ROLL_SCHEMA])  # how vLLM renders them
    assert chat_template_ids(tokenizer, messages, [ROLL_SCHEMA]) == served
