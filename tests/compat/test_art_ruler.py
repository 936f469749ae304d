"""RULER as ART users call it: LiteLLM-style judge strings through the real `litellm` package (and without it, for
OpenAI-compatible providers), against a judge server on 127.0.0.1; a new group back, the input untouched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import art_adapters as art
from art_adapters.rewards import RulerError, ruler, ruler_score_group
from art_adapters.rewards import judge as judge_module
from art_adapters.testing import Reply, ScriptedServer

PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}]


def verdict(request: dict[str, Any]) -> Reply:
    """Scores in the order asked: 1.0, 0.5, 0.0, ... (the ids are read from the prompt)."""
    prompt = request["messages"][-1]["content"]
    count = prompt.count("<trajectory id=")
    scores = [
        {"trajectory_id": str(i), "explanation": f"why {i}", "score": 1 - (i - 1) / 2}
        for i in range(1, count + 1)
    ]
    return Reply(content=json.dumps({"scores": scores}))


@pytest.fixture
def judge_server() -> Iterator[ScriptedServer]:
    with ScriptedServer(verdict) as server:
        yield server


def group_of(*answers: str) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[*PROMPT, {"role": "assistant", "content": a}], reward=0.1)
        for a in answers
    )


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
async def test_litellm_judge_string_returns_a_new_group(
    judge_server: ScriptedServer, provider: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert judge_module.litellm_module() is not None  # the real package, from the [litellm] extra
    original = group_of("Paris", "Lyon")
    scored = await ruler_score_group(
        original,
        f"{provider}/judge-7b",
        extra_litellm_params={"api_base": judge_server.base_url, "api_key": "secret"},
        rubric="Correct answers win.",
        debug=True,
    )
    assert scored is not None and scored is not original
    assert [t.reward for t in scored] == [1.0, 0.5] and [t.reward for t in original] == [0.1, 0.1]
    assert [t.metrics["independent_reward"] for t in scored] == [0.1, 0.1]
    assert not original.trajectories[0].metrics and not original.trajectories[0].logs
    (request,) = judge_server.requests
    assert request["model"] == "judge-7b" and "Correct answers win." in request["messages"][0]["content"]
    assert request["response_format"]["type"] == "json_schema"
    assert "[1] 1.000  why 1" in capsys.readouterr().out


async def test_identical_trajectories_are_judged_once_and_share_the_score(
    judge_server: ScriptedServer,
) -> None:
    scored = await ruler_score_group(
        group_of("Paris", "Lyon", "Paris"),
        "openai/judge",
        extra_litellm_params={"api_base": judge_server.base_url, "api_key": "k"},
    )
    assert scored is not None and [t.reward for t in scored] == [1.0, 0.5, 1.0]
    assert judge_server.requests[0]["messages"][-1]["content"].count("<trajectory id=") == 2


async def test_ruler_on_message_lists(judge_server: ScriptedServer) -> None:
    lists = [[*PROMPT, {"role": "assistant", "content": a}] for a in ("Paris", "Nice")]
    scores = await ruler(lists, "openai/judge", {"api_base": judge_server.base_url, "api_key": "k"})
    assert [(s.trajectory_id, s.score, s.explanation) for s in scores] == [
        ("1", 1.0, "why 1"),
        ("2", 0.5, "why 2"),
    ]


async def test_without_litellm_openai_compatible_judges_still_work(
    judge_server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(judge_module, "litellm_module", lambda: None)
    monkeypatch.setenv("OPENAI_BASE_URL", judge_server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    scored = await ruler_score_group(group_of("Paris", "Lyon"), "openai/judge-env")
    assert scored is not None and [t.reward for t in scored] == [1.0, 0.5]
    assert judge_server.requests[-1]["model"] == "judge-env"
    scored = await ruler_score_group(
        group_of("Paris", "Lyon"),
        "hosted_vllm/judge-vllm",
        {"api_base": judge_server.base_url, "temperature": 0.3},
    )
    assert (
        judge_server.requests[-1]["model"] == "judge-vllm" and judge_server.requests[-1]["temperature"] == 0.3
    )
    with pytest.raises(RulerError, match=r"art-adapters\[litellm\]"):
        await ruler_score_group(group_of("a", "b"), "anthropic/claude-sonnet")
    assert (
        await ruler_score_group(group_of("a", "b"), "anthropic/claude-sonnet", swallow_exceptions=True)
        is None
    )


def reasoning_judge(request: dict[str, Any]) -> Reply:
    """Answers as OpenAI's reasoning models do: any temperature but the default is a 400."""
    if request.get("temperature") not in (None, 1, 1.0):
        message = "Unsupported value: 'temperature' does not support 0.0 with this model. Only the default (1) value is supported."
        return Reply(
            status=400, raw_body=json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
        )
    return verdict(request)


@pytest.mark.parametrize("judge", ["openai/o4-mini", "openai/judge-7b"])
async def test_a_reasoning_judge_is_asked_without_a_temperature(
    judge: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ART's LangGraph email example judges with "openai/o4-mini"; RULER's temperature 0 is refused by such
    judges (LiteLLM refuses it before sending). o-series and gpt-5 names get none; any judge that refuses one is
    asked again without it."""
    with ScriptedServer(reasoning_judge) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
        scored = await ruler_score_group(
            group_of("Paris", "Lyon"), judge, extra_litellm_params={"api_base": server.base_url}
        )
        assert scored is not None and [t.reward for t in scored] == [1.0, 0.5]
        accepted = [r for r in server.requests if "temperature" not in r]
        assert accepted and server.requests[-1] is accepted[-1]
        if judge == "openai/o4-mini":
            assert len(server.requests) == 1  # known to take no temperature: asked once, without one
