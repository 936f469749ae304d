"""The Responses API against vLLM's own `/v1/responses` on the tiny model: token ids captured (vLLM's
`enable_response_messages`), the chat view of a Responses request reproduces the engine's prompt ids, and the
Agents SDK's default `OpenAIResponsesModel` trains unchanged through LocalBackend (trained tokens == sampled)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from art_adapters.openai_agents import wrap_rollout
from art_adapters.testing import steer
from art_adapters.training.tokenize import chat_template_ids, tokenize_trajectory
from art_adapters.trajectories import Trajectory
from fixtures_vllm import registered_on

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

EMPTY_CALL = '<tool_call>\n{"name": "roll", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def roll() -> str:
    return "4"


async def test_responses_json_and_stream_capture_the_engine_tokens(
    vllm_server: VLLMServer, tokenizer: Any, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="responder", project="responses") as (_, model):
        client = model.openai_client()
        async with art.capture() as trajectory:
            await client.responses.create(
                model=model.get_inference_name(),
                input="Say hi.",
                instructions="Be brief.",
                max_output_tokens=6,
            )
            stream = await client.responses.create(
                model=model.get_inference_name(), input="Say more.", max_output_tokens=6, stream=True
            )
            async for _ in stream:
                pass
    for call, streamed in zip(trajectory.llm_calls, (False, True), strict=True):
        assert call.api == "responses" and call.stream is streamed and call.error is None
        assert call.prompt_token_ids == chat_template_ids(
            tokenizer, call.request_messages(), call.request_tools()
        )
        ids = call.completion_token_ids or []
        assert 1 <= len(ids) <= 6
        text = (call.response_message() or {}).get("content") or ""
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        # the engine's text holds back a last character whose bytes were cut by max_output_tokens
        assert decoded == text or (decoded.startswith(text) and set(decoded[len(text) :]) == {"\ufffd"})
        if not streamed:  # a stream's logprobs are kept only where they can be aligned (see below)
            assert call.logprobs is not None and len(call.logprobs) == len(ids)
        assert call.logprobs is None or all(lp <= 0 for lp in call.logprobs if not math.isnan(lp))


@pytest.mark.parametrize(
    ("text", "aligned"), [("hello world ok", True), ("héllo wörld ✓ 𓂀 ok", False)], ids=["ascii", "multibyte"]
)
async def test_streamed_responses_logprobs_are_aligned_or_marked_missing(
    vllm_server: VLLMServer, tokenizer: Any, tmp_path: Path, text: str, aligned: bool
) -> None:
    """vLLM's Responses stream drops the logprobs of steps whose text delta is empty (the stop token, a byte inside
    a multi-byte character). Captured logprobs equal chat completions' for the same ids, token for token, or are
    None (counted as missing by the trainer); never shifted onto later tokens."""
    async with registered_on(vllm_server, tmp_path, name="aligner", project="responses") as (_, model):
        client = model.openai_client()
        # one seed for the three calls: where the text allows two tokenizations of equal bias (a space before a
        # multi-byte character), each call samples the same one
        steered = {**steer(tokenizer, text), "seed": 7}
        options = {"max_output_tokens": 64, "temperature": 1.0, "extra_body": steered}
        async with art.capture() as trajectory:
            await client.responses.create(model=model.get_inference_name(), input="Say it.", **options)
            stream = await client.responses.create(
                model=model.get_inference_name(), input="Say it.", stream=True, **options
            )
            async for _ in stream:
                pass
            chat = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": "Say it."}],
                max_tokens=64,
                temperature=1.0,
                extra_body=steered,
            )
    json_call, stream_call, chat_call = trajectory.llm_calls
    ids = chat_call.completion_token_ids or []
    assert tokenizer.decode(ids) == text + "<|im_end|>" and chat.choices[0].message.content == text
    reference = chat_call.logprobs or []
    assert json_call.completion_token_ids == stream_call.completion_token_ids == ids
    assert json_call.logprobs == pytest.approx(
        reference, abs=1e-4
    )  # JSON: every token's, the stop token's too
    if aligned:
        assert stream_call.logprobs is not None and math.isnan(stream_call.logprobs[-1])  # the stop token
        assert stream_call.logprobs[:-1] == pytest.approx(reference[:-1], abs=1e-4)
    else:
        assert stream_call.logprobs is None
    # as if sampled without steering (steered tokens lose their ratio anyway): missing logprobs are counted
    unsteered = {
        k: v for k, v in stream_call.request.items() if k not in ("structured_outputs", "logit_bias")
    }
    call = stream_call.model_copy(update={"request": unsteered})
    out = tokenize_trajectory(Trajectory(llm_calls=[call]), tokenizer, max_seq_len=512)
    assert out.excluded_tokens == 0 and out.missing_tokens == (1 if aligned else len(ids))


async def test_agents_sdk_default_responses_model_trains_unchanged(
    vllm_server: VLLMServer, tokenizer: Any, tmp_path: Path
) -> None:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    tool = function_tool(roll, name_override="roll", description_override="Roll a die.", strict_mode=False)
    async with registered_on(vllm_server, tmp_path, name="roller", project="responses") as (_, model):
        assert model.inference_base_url is not None

        @wrap_rollout(model)
        async def rollout(reward: float) -> float:
            client = AsyncOpenAI(
                base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0
            )
            agent = Agent(  # the agent's own client and the SDK's default model kind: nothing of ours
                name="roller",
                instructions="Roll a die.",
                tools=[tool],
                model=OpenAIResponsesModel(model=model.get_inference_name(), openai_client=client),
                model_settings=ModelSettings(  # seeded: of the text's equally biased tokenizations, seed 1 samples the
                    # template's own every time (unseeded, one run in a few did not; seed 7 never does)
                    max_tokens=40,
                    extra_body={**steer(tokenizer, EMPTY_CALL), "seed": 1},
                ),
            )
            with pytest.raises(MaxTurnsExceeded):
                await Runner.run(agent, "Roll a die.", max_turns=2)
            return reward

        group = await art.TrajectoryGroup(rollout(r) for r in (1.0, 0.0))
        sampled = 0
        for trajectory in group:
            assert len(trajectory.llm_calls) == 2
            for call in trajectory.llm_calls:
                assert call.api == "responses" and call.source.agent == "roller"
                assert call.prompt_token_ids == chat_template_ids(
                    tokenizer, call.request_messages(), call.request_tools()
                )
                assert tokenizer.decode(call.completion_token_ids or []) == EMPTY_CALL + "<|im_end|>"
                assert call.response_message()["tool_calls"][0]["function"]["name"] == "roll"  # type: ignore[index]
                sampled += len(call.completion_token_ids or [])
            first, second = trajectory.llm_calls  # steered to the template's own tokens: one chained sequence
            whole = (first.prompt_token_ids or []) + (first.completion_token_ids or [])
            assert (second.prompt_token_ids or [])[: len(whole)] == whole
        metrics = await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
    assert metrics["trained_tokens"] == sampled and metrics["sequences"] == 2
    assert metrics["sampled_token_fraction"] == 1.0
