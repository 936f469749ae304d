"""Anthropic's Messages API against vLLM's own `/v1/messages` on the tiny model: the real `anthropic` SDK, JSON and
streamed, recorded by ART main's scope; our chat view of each request is what the engine rendered (its input token
count equals the template's); no token ids on this API, so the trainer takes it only as re-tokenized text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from art_adapters.training.tokenize import chat_template_ids
from fixtures_vllm import registered_on

anthropic = pytest.importorskip("anthropic")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


async def test_messages_api_json_and_stream_on_vllm(
    vllm_server: VLLMServer, tokenizer: Any, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="claude-like", project="messages") as (
        backend,
        model,
    ):
        assert model.inference_base_url is not None
        client = anthropic.AsyncAnthropic(  # vLLM checks `Authorization: Bearer`, which `auth_token` sends
            base_url=model.inference_base_url.removesuffix("/v1"),
            auth_token=model.inference_api_key,
            max_retries=0,
        )
        name = model.get_inference_name()

        async def rollout(reward: float) -> None:
            history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
            first = await client.messages.create(
                model=name, max_tokens=6, system="Be brief.", messages=history, tools=TOOLS
            )
            history.append({"role": "assistant", "content": [b.model_dump() for b in first.content] or "..."})
            history.append({"role": "user", "content": "And tomorrow?"})
            async with client.messages.stream(
                model=name, max_tokens=6, system="Be brief.", messages=history, tools=TOOLS
            ) as stream:
                await stream.get_final_message()
            art.current_trajectory(required=True).reward = reward

        group = await art.trajectory_group(art.trajectory(rollout(r)) for r in (1.0, 0.0))
        for trajectory in group.trajectories:
            for call, streamed in zip(trajectory.llm_calls, (False, True), strict=True):
                assert (call.api, call.stream, call.error) == ("messages", streamed, None)
                assert call.prompt_token_ids is None and call.completion_token_ids is None
                # what we read from the request is what the engine rendered
                rendered = chat_template_ids(tokenizer, call.request_messages(), call.request_tools())
                assert (call.response or {})["usage"]["input_tokens"] == len(rendered)
                assert 1 <= (call.response or {})["usage"]["output_tokens"] <= 6
            assert trajectory.tools and trajectory.tools[0]["function"]["name"] == "get_weather"

        # text only: nothing is trained unless asked; asked, the certificate says none of it was sampled
        result = await backend.train(model, [group], config=art.TrainConfig(learning_rate=1e-5))
        assert result.metrics["groups_without_samples"] == 1 and result.metrics["trained_tokens"] == 0
        config = art.TrainConfig(learning_rate=1e-5, train_retokenized_text=True)
        result = await backend.train(model, [group], config=config)
        assert result.metrics["sampled_token_fraction"] == 0.0 and result.metrics["trained_tokens"] > 0
