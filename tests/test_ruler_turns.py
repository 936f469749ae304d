"""The per-turn RULER against a ScriptedServer judge (real HTTP, the real openai client): one request per turn
index (or per state), each call's score its reward, RULER's retries and errors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import art_adapters as art
from art_adapters.rewards import RulerError, ruler_score_turns
from art_adapters.testing import Reply, ScriptedServer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup


@pytest.fixture
def judge() -> Iterator[Any]:
    servers: list[ScriptedServer] = []

    def start(script: Any, *, cycle: bool = False) -> tuple[ScriptedServer, openai.AsyncOpenAI]:
        server = ScriptedServer(script, cycle=cycle).start()
        servers.append(server)
        return server, openai.AsyncOpenAI(base_url=server.base_url, api_key="test-key")

    yield start
    for server in servers:
        server.stop()


def step(prompt: list[int], history: list[dict[str, Any]], answer: str) -> LLMCall:
    return LLMCall(
        request={"model": "agent", "messages": history},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
        url="http://x/v1/chat/completions",
        prompt_token_ids=prompt,
        completion_token_ids=[9],
    )


def rollout(answers: list[str]) -> Trajectory:
    history: list[dict[str, Any]] = [{"role": "user", "content": "Look up order 17, then refund it."}]
    calls, prompt = [], [1, 2]
    for answer in answers:
        calls.append(step(list(prompt), list(history), answer))
        history = [*history, {"role": "assistant", "content": answer}, {"role": "tool", "content": "ok"}]
        prompt = [*prompt, *(ord(c) for c in answer), 3]
    return Trajectory(llm_calls=calls, reward=0.5)


def group() -> TrajectoryGroup:
    return TrajectoryGroup(
        [
            rollout(["lookup(17)", "refund(17)"]),
            rollout(["lookup(71)", "lookup(17)", "refund(17)"]),  # an early wrong call, repaired
            rollout(["lookup(17)", "refund(17)"]),  # identical to the first: judged once
        ]
    )


def scorer(request: dict[str, Any]) -> Reply:
    """Score each attempt by its last step: a refund 0.9, the right lookup 0.6, anything else 0.1."""
    text = request["messages"][-1]["content"]
    ids = re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', text, re.S)
    scores = []
    for tid, body in ids:
        last = body.strip().splitlines()[-1]
        score = 0.9 if "refund(17)" in last else 0.6 if "lookup(17)" in last else 0.1
        scores.append({"trajectory_id": tid, "explanation": f"last step {last}", "score": score})
    return Reply(content=json.dumps({"scores": scores}))


async def test_each_turn_index_is_one_judge_request_and_scores_become_call_rewards(judge: Any) -> None:
    server, client = judge(scorer, cycle=True)
    original = group()
    scored = await ruler_score_turns(original, "judge-model", client=client, retry_delay=0)
    assert scored is not None
    assert len(server.requests) == 3  # turn 0, 1, 2: one request each, never one per call
    assert [[c.reward for c in t.llm_calls] for t in scored] == [[0.6, 0.9], [0.1, 0.6, 0.9], [0.6, 0.9]]
    assert [t.reward for t in scored] == [0.5, 0.5, 0.5]  # trajectory rewards untouched
    assert all(c.reward is None for t in original for c in t.llm_calls)  # a new group, the input untouched
    # identical steps judged once: turns 0 and 1 hold 3 calls but 2 distinct steps each, turn 2 one call (the
    # turns are judged concurrently, so the requests arrive in any order)
    sizes = sorted(r["messages"][-1]["content"].count("<trajectory id=") for r in server.requests)
    assert sizes == [1, 2, 2]
    assert scored.trajectories[1].metrics["ruler_turn_scores"] == 3
    assert any("RULER turn 0" in line for line in scored.trajectories[1].logs)
    assert "ONE step" in server.requests[0]["messages"][0]["content"]  # the per-step rubric


async def test_by_state_judges_only_states_several_calls_reached(judge: Any) -> None:
    server, client = judge(scorer, cycle=True)
    scored = await ruler_score_turns(group(), "judge-model", client=client, by="state", retry_delay=0)
    assert scored is not None
    # the start state is shared by all three; after "lookup(17)" two reach the same state (the same prompt ids)
    assert len(server.requests) == 2
    rewards = [[c.reward for c in t.llm_calls] for t in scored]
    assert rewards[0] == [0.6, 0.9] and rewards[2] == [0.6, 0.9]
    assert rewards[1][0] == 0.1 and rewards[1][1:] == [None, None]  # its later states are its own


async def test_judge_errors_are_ruler_s(judge: Any) -> None:
    server, client = judge(["not JSON"], cycle=True)
    with pytest.raises(RulerError, match="no valid answer"):
        await ruler_score_turns(group(), "judge-model", client=client, max_retries=1, retry_delay=0)
    assert (
        await ruler_score_turns(
            group(), "judge-model", client=client, max_retries=0, retry_delay=0, swallow_exceptions=True
        )
        is None
    )
    with pytest.raises(ValueError, match="'turn' or 'state'"):
        await ruler_score_turns(group(), "judge-model", client=client, by="call")  # type: ignore[arg-type]
    _, good = judge([Reply(status=500), Reply(content=json.dumps({"scores": []}))])
    empty = TrajectoryGroup([Trajectory(reward=1.0)])
    assert (await ruler_score_turns(empty, "judge-model", client=good)).trajectories[0].reward == 1.0


def test_exported_from_the_package() -> None:
    assert art.ruler_score_turns is ruler_score_turns
    assert callable(art.reward_call)
