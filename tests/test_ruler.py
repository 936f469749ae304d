"""RULER against a ScriptedServer judge (real HTTP, real openai.AsyncOpenAI): answers, bad answers, retries."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from art_adapters.capture import capture
from art_adapters.gather import gather_trajectory_groups
from art_adapters.model import Model
from art_adapters.rewards import (
    RulerError,
    common_prefix_length,
    extract_json,
    judge_messages,
    response_schema,
    ruler,
    ruler_score_group,
)
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import Trajectory, TrajectoryGroup

ruler_module = sys.modules["art_adapters.rewards.ruler"]  # the package's `ruler` is the function


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[ScriptedServer, openai.AsyncOpenAI]]]:
    """Start a ScriptedServer judge; returns it and a real AsyncOpenAI client pointed at it."""
    ruler_module._NO_SCHEMA.clear()
    servers: list[ScriptedServer] = []

    def start(script: Any, *, cycle: bool = False) -> tuple[ScriptedServer, openai.AsyncOpenAI]:
        server = ScriptedServer(script, cycle=cycle).start()
        servers.append(server)
        return server, openai.AsyncOpenAI(base_url=server.base_url, api_key="test-key")

    yield start
    for server in servers:
        server.stop()


PREFIX = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the capital of Australia? Answer in one word."},
]
ANSWERS = ["Canberra", "Sydney", "I am not sure, maybe Melbourne or Canberra."]


def make_group() -> TrajectoryGroup:
    return TrajectoryGroup(
        Trajectory(
            messages_and_choices=[*PREFIX, {"role": "assistant", "content": a}],
            reward=float(i) / 10,
            metrics={"steps": 1},
        )
        for i, a in enumerate(ANSWERS)
    )


def answer(scores: list[tuple[str, float]], **extra: Any) -> str:
    return json.dumps(
        {
            "scores": [{"trajectory_id": t, "explanation": f"reason {t}", "score": s} for t, s in scores],
            **extra,
        }
    )


GOOD = answer([("1", 0.9), ("2", 0.1), ("3", 0.5)])
ORIGINAL = [0.0, 0.1, 0.2]


def rewards(group: TrajectoryGroup) -> list[float]:
    return [t.reward for t in group]


def assert_untouched(group: TrajectoryGroup) -> None:
    assert rewards(group) == ORIGINAL
    for t in group:
        assert "independent_reward" not in t.metrics and "ruler_explanation" not in t.metadata and not t.logs


# ---------------------------------------------------------------------------------------------- happy path


async def test_scores_set_rewards_independent_reward_and_explanations(serve) -> None:
    server, client = serve([GOOD])
    original = make_group()
    group = await ruler_score_group(original, "judge-model", client=client)
    assert group is not original  # ART's contract: a new group, the input left as it was
    assert_untouched(original)
    assert rewards(group) == [0.9, 0.1, 0.5]
    assert [t.metrics["independent_reward"] for t in group] == ORIGINAL
    assert [t.metadata["ruler_explanation"] for t in group] == ["reason 1", "reason 2", "reason 3"]
    assert group.trajectories[0].logs == ["RULER explanation (judge-model, score 0.900): reason 1"]
    assert group.trajectories[0].metrics["steps"] == 1
    assert len(server.requests) == 1


async def test_request_states_shared_prefix_once_and_asks_for_the_schema(serve) -> None:
    server, client = serve([GOOD])
    await ruler_score_group(
        make_group(), "judge-model", client=client, temperature=0.0, extra_body={"seed": 7}
    )
    (request,) = server.requests
    assert request["model"] == "judge-model" and request["temperature"] == 0.0 and request["seed"] == 7
    prompt = request["messages"][-1]["content"]
    assert prompt.count("capital of Australia") == 1 and prompt.count("careful assistant") == 1
    assert prompt.index("capital of Australia") < prompt.index('<trajectory id="1">')
    for i, a in enumerate(ANSWERS, start=1):
        block = prompt.split(f'<trajectory id="{i}">')[1].split("</trajectory>")[0]
        assert a in block and "capital" not in block
    fmt = request["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    scores = fmt["json_schema"]["schema"]["properties"]["scores"]
    assert scores["minItems"] == scores["maxItems"] == 3
    assert scores["items"]["properties"]["trajectory_id"]["enum"] == ["1", "2", "3"]
    assert scores["items"]["properties"]["score"] == {"type": "number", "minimum": 0, "maximum": 1}


async def test_temperature_none_is_left_out(serve) -> None:
    server, client = serve([GOOD])
    await ruler_score_group(make_group(), "judge-model", client=client, temperature=None, max_tokens=50)
    assert "temperature" not in server.requests[0] and server.requests[0]["max_tokens"] == 50


def test_ordered_schema_pins_each_position_and_bounds_explanations() -> None:
    schema = response_schema(["1", "2"], max_explanation_chars=30, ordered_ids=True)
    scores = schema["properties"]["scores"]
    assert scores["items"] is False and scores["minItems"] == scores["maxItems"] == 2
    assert [p["properties"]["trajectory_id"]["const"] for p in scores["prefixItems"]] == ["1", "2"]
    assert scores["prefixItems"][0]["properties"]["explanation"]["maxLength"] == 30


def test_prompt_without_shared_prefix_and_with_tools() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = judge_messages(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], tools=tools
    )
    prompt = messages[1]["content"]
    assert "<context>" not in prompt and '"lookup"' in prompt
    assert "custom rule" in judge_messages([[], []], rubric="custom rule")[0]["content"]


async def test_fenced_json_with_prose_is_accepted(serve) -> None:
    server, client = serve([f"Here is my verdict.\n```json\n{GOOD}\n```\nHope this helps!"])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client)
    assert rewards(group) == [0.9, 0.1, 0.5] and len(server.requests) == 1


async def test_leading_prose_and_trailing_text_accepted(serve) -> None:
    _, client = serve([f"<think>hmm {{not json</think>Sure: {GOOD} -- done"])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client)
    assert rewards(group) == [0.9, 0.1, 0.5]


async def test_ruler_on_message_lists_returns_scores(serve) -> None:
    _, client = serve([answer([("1", 1), ("2", 0)])])
    convs = [[*PREFIX, {"role": "assistant", "content": a}] for a in ANSWERS[:2]]
    scores = await ruler(convs, "judge-model", client=client)
    assert [(s.trajectory_id, s.score, s.explanation) for s in scores] == [
        ("1", 1.0, "reason 1"),
        ("2", 0.0, "reason 2"),
    ]


async def test_order_of_entries_does_not_matter(serve) -> None:
    _, client = serve([answer([("3", 0.5), ("1", 0.9), ("2", 0.1)])])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client)
    assert rewards(group) == [0.9, 0.1, 0.5]


async def test_art_model_as_judge_and_its_call_is_not_recorded(serve) -> None:
    server, _ = serve([GOOD])
    judge = Model(
        name="judge", inference_base_url=server.base_url, inference_api_key="k", inference_model_name="big"
    )
    group = make_group()
    async with capture() as rollout:  # e.g. judging from inside a rollout: the judge call stays out of it
        group = await ruler_score_group(group, judge)
    assert rewards(group) == [0.9, 0.1, 0.5] and server.requests[0]["model"] == "big"
    assert rollout.llm_calls == []


# ---------------------------------------------------------------------------------------------- bad answers


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("I think the first one is best.", "not JSON"),
        ("", "empty answer"),
        (answer([("1", 0.9), ("2", 0.1)]), "expected 3 scores, got 2"),
        (answer([("1", 0.9), ("2", 1.5), ("3", 0.5)]), "out of range"),
        (answer([("1", 0.9), ("2", "high"), ("3", 0.5)]), "not a number"),
        (answer([("1", 0.9), ("2", 0.1), ("7", 0.5)]), "unknown trajectory id '7'"),
        (answer([("1", 0.9), ("1", 0.1), ("3", 0.5)]), "scored twice"),
        (json.dumps({"verdict": "ok"}), "no 'scores' list"),
    ],
)
async def test_bad_answer_retried_then_raises(serve, content: str, problem: str) -> None:
    server, client = serve([content], cycle=True)
    group = make_group()
    with pytest.raises(RulerError, match=problem):
        await ruler_score_group(group, "judge-model", client=client, max_retries=2, retry_delay=0)
    assert len(server.requests) == 3  # first try + 2 retries
    assert_untouched(group)


async def test_bad_answer_then_good_one_and_correction_is_sent(serve) -> None:
    server, client = serve(["not json at all", answer([("1", 0.9), ("2", 0.1)]), GOOD])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client, retry_delay=0)
    assert rewards(group) == [0.9, 0.1, 0.5] and len(server.requests) == 3
    retry = server.requests[2]["messages"]
    assert retry[-2]["role"] == "assistant" and "expected 3 scores, got 2" in retry[-1]["content"]
    assert all("response_format" in r for r in server.requests)


async def test_empty_answer_retried_without_correction(serve) -> None:
    server, client = serve(["", GOOD])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client, retry_delay=0)
    assert len(server.requests) == 2 and server.requests[0]["messages"] == server.requests[1]["messages"]
    assert rewards(group) == [0.9, 0.1, 0.5]


async def test_400_on_response_format_falls_back_without_it(serve) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        return Reply(status=400) if "response_format" in request else Reply(content=GOOD)

    server, client = serve(responder)
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client, max_retries=0)
    assert rewards(group) == [0.9, 0.1, 0.5]
    assert ["response_format" in r for r in server.requests] == [True, False]
    await ruler_score_group(make_group(), "judge-model", client=client)  # remembered for this endpoint
    assert ["response_format" in r for r in server.requests] == [True, False, False]


async def test_400_without_response_format_raises_at_once(serve) -> None:
    server, client = serve([Reply(status=400)], cycle=True)
    group = make_group()
    with pytest.raises(RulerError, match="rejected the request.*400"):
        await ruler_score_group(group, "judge-model", client=client, retry_delay=0)
    assert len(server.requests) == 2  # with the schema, then once without; never retried
    assert_untouched(group)


async def test_500_is_retried(serve) -> None:
    server, client = serve([Reply(status=500), Reply(status=503), GOOD])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client, max_retries=2, retry_delay=0)
    assert rewards(group) == [0.9, 0.1, 0.5] and len(server.requests) == 3


async def test_persistent_500_raises_after_retries(serve) -> None:
    server, client = serve([Reply(status=500)], cycle=True)
    group = make_group()
    with pytest.raises(RulerError, match="3 attempt.*request failed"):
        await ruler_score_group(group, "judge-model", client=client, max_retries=2, retry_delay=0)
    assert len(server.requests) == 3  # the openai client's own retries are off: this loop counts
    assert_untouched(group)


async def test_401_is_not_retried(serve) -> None:
    server, client = serve([Reply(status=401)], cycle=True)
    with pytest.raises(RulerError, match="401"):
        await ruler_score_group(make_group(), "judge-model", client=client, retry_delay=0)
    assert len(server.requests) == 1


async def test_swallow_exceptions_drops_group_and_warns(serve, caplog) -> None:
    server, client = serve(["nope"], cycle=True)
    group = make_group()
    with caplog.at_level(logging.WARNING, logger="art_adapters.rewards.ruler"):
        result = await ruler_score_group(
            group, "judge-model", client=client, swallow_exceptions=True, max_retries=1, retry_delay=0
        )
    assert result is None and len(server.requests) == 2
    assert "dropped a group of 3" in caplog.text and "not JSON" in caplog.text
    assert_untouched(group)


async def test_second_judging_keeps_the_original_independent_reward(serve) -> None:
    _, client = serve([GOOD, answer([("1", 0.2), ("2", 0.3), ("3", 0.4)])])
    group = make_group()
    group = await ruler_score_group(group, "judge-model", client=client)
    group = await ruler_score_group(group, "judge-model", client=client)
    assert rewards(group) == [0.2, 0.3, 0.4]
    assert [t.metrics["independent_reward"] for t in group] == ORIGINAL


async def test_empty_group_makes_no_request(serve) -> None:
    server, client = serve([GOOD])
    result = await ruler_score_group(TrajectoryGroup([]), "judge-model", client=client)
    assert result is not None and len(result) == 0
    assert server.requests == []


# ---------------------------------------------------------------------------------------------- in gather


async def test_as_after_each_in_gather_scores_and_drops_failed_groups(serve) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        if "drop me" in request["messages"][1]["content"]:  # the judge prompt proper, not a correction
            return Reply(content="no verdict")
        return Reply(content=answer([("1", 1.0), ("2", 0.0)]))

    server, client = serve(responder)

    async def rollout(question: str, k: int) -> Trajectory:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": f"answer {k}"}]
        return Trajectory(messages_and_choices=messages, reward=0.5)

    questions = ["What is 2 + 2?", "drop me", "Name a colour."]
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(rollout(q, k) for k in range(2)) for q in questions),
        pbar_desc=None,
        after_each=lambda g: ruler_score_group(
            g, "judge-model", client=client, swallow_exceptions=True, max_retries=1, retry_delay=0
        ),
    )
    assert len(groups) == 2  # the group the judge could not score is dropped
    for group in groups:
        assert rewards(group) == [1.0, 0.0]
        assert [t.metrics["independent_reward"] for t in group] == [0.5, 0.5]
    assert len(server.requests) == 2 + 2  # one request per good group, two tries for the dropped one


# ---------------------------------------------------------------------------------------------- helpers


def test_extract_json_forms() -> None:
    assert extract_json('{"a": 1}') == {"a": 1}
    assert extract_json('Text\n```json\n{"a": 2}\n```') == {"a": 2}
    assert extract_json('```\n{"a": 3}\n```') == {"a": 3}
    assert extract_json('Answer: {"a": 4} and then [1]') == {"a": 4}
    assert extract_json("see [1, 2] ok") == [1, 2]
    with pytest.raises(ValueError):
        extract_json("no json {here")


def test_common_prefix_length() -> None:
    a, b, c = ({"role": "user", "content": x} for x in "abc")
    assert common_prefix_length([[a, b], [a, c], [a, b, c]]) == 1
    assert common_prefix_length([[a, b], [a, b]]) == 2
    assert common_prefix_length([[a], [b]]) == 0
    assert common_prefix_length([]) == 0
