"""RULER against the real vLLM server on the tiny model: guided JSON decoding yields a parseable, valid answer.

The tiny random model's scores mean nothing; what is checked is the schema path. Guided decoding lets JSON
whitespace run on forever unless vLLM is told to emit compact JSON, which VLLMServer always does
(`--structured-outputs-config {"backend": "xgrammar", "disable_any_whitespace": true}`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio

from art_adapters.inference import VLLMServer
from art_adapters.model import Model
from art_adapters.rewards import extract_json, judge_messages, response_schema, ruler_score_group
from art_adapters.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.vllm

BOUNDS: dict[str, Any] = {
    "max_tokens": 400,
    "max_explanation_chars": 48,
}  # a random model must still terminate


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def judge_server(vllm_server: VLLMServer) -> AsyncIterator[VLLMServer]:
    """The shared server: VLLMServer always passes compact guided-JSON settings (no free whitespace)."""
    assert any("disable_any_whitespace" in arg for arg in vllm_server.command())
    yield vllm_server


def make_group() -> TrajectoryGroup:
    prefix = [{"role": "user", "content": "Say hello to the user."}]
    return TrajectoryGroup(
        Trajectory(messages_and_choices=[*prefix, {"role": "assistant", "content": a}], reward=0.25)
        for a in ["Hello!", "Goodbye.", "hello hello hello"]
    )


def recording_client(server: VLLMServer, bodies: list[dict[str, Any]]) -> openai.AsyncOpenAI:
    async def keep(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    http = httpx.AsyncClient(timeout=120.0, event_hooks={"request": [keep]})
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, http_client=http)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_default_schema_answer_conforms(judge_server: VLLMServer, temperature: float) -> None:
    group = make_group()
    ids = ["1", "2", "3"]
    schema = response_schema(ids, max_explanation_chars=BOUNDS["max_explanation_chars"])
    client = openai.AsyncOpenAI(base_url=judge_server.base_url, api_key=judge_server.api_key, max_retries=0)
    response = await client.chat.completions.create(
        model=judge_server.model_name,
        messages=judge_messages([t.messages() for t in group]),  # type: ignore[arg-type]
        temperature=temperature,
        seed=0,
        max_tokens=BOUNDS["max_tokens"],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    answer = extract_json(choice.message.content or "")
    jsonschema.validate(answer, schema)
    assert len(answer["scores"]) == 3
    assert all(entry["trajectory_id"] in ids and 0 <= entry["score"] <= 1 for entry in answer["scores"])


async def test_ruler_score_group_end_to_end(judge_server: VLLMServer) -> None:
    bodies: list[dict[str, Any]] = []
    client = recording_client(judge_server, bodies)
    group = make_group()
    result = await ruler_score_group(
        group, judge_server.model_name, client=client, ordered_ids=True, max_retries=0, **BOUNDS
    )
    assert result is not None and result is not group  # a new group, as in ART
    assert (
        len(bodies) == 1 and bodies[0]["response_format"]["json_schema"]["strict"] is True
    )  # one try, schema on
    assert all(t.reward == 0.25 and "independent_reward" not in t.metrics for t in group)  # input untouched
    for t in result:
        assert 0.0 <= t.reward <= 1.0
        assert t.metrics["independent_reward"] == 0.25
        assert isinstance(t.metadata["ruler_explanation"], str) and t.logs


async def test_art_model_as_judge(judge_server: VLLMServer) -> None:
    judge = Model(
        name="judge",
        inference_base_url=judge_server.base_url,
        inference_api_key=judge_server.api_key,
        inference_model_name=judge_server.model_name,
    )
    scored = await ruler_score_group(make_group(), judge, ordered_ids=True, max_retries=0, **BOUNDS)
    assert scored is not None and all(t.metadata["ruler_judge"] == judge_server.model_name for t in scored)
