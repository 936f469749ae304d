"""The data contract: exact JSON/JSONL round trips, awaitable groups, and conversations rebuilt from captured calls."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.capture import capture
from art_adapters.recording import async_openai_client, openai_client
from art_adapters.testing import Reply, ScriptedServer, prompt_text, token_ids
from art_adapters.trajectories import (
    LLMCall,
    SampledChoice,
    Trajectory,
    TrajectoryGroup,
    read_jsonl,
    write_jsonl,
)


def choice_with_extras() -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            "logprobs": {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}]},
            "token_ids": [5, 6, 151645],
            "prompt_token_ids": [1, 2, 3],
        }
    )


def rich_trajectory() -> Trajectory:
    call = LLMCall(
        request={"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2},
        response={
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}
            ]
        },
        url="http://x/v1/chat/completions",
        status_code=200,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[151643, 0, 7],
        logprobs=[-0.1, -1e-9, -12.5],
        other_choices=[SampledChoice(index=1, token_ids=[9], logprobs=[-0.5], finish_reason="length")],
        logprobs_mode="processed_logprobs",
        latency_s=0.125,
    )
    return Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            choice_with_extras(),
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        reward=0.75,
        metrics={"turns": 2, "ok": True},
        metadata={"scenario": "s1", "seed": 3, "none": None},
        logs=["note"],
        llm_calls=[call],
        additional_histories=[
            art.History(messages_and_choices=[{"role": "user", "content": "sub"}], llm_calls=[call])
        ],
    )


def test_json_round_trip_is_exact() -> None:
    trajectory = rich_trajectory()
    back = Trajectory.from_json(trajectory.to_json())
    assert back.model_dump() == trajectory.model_dump()
    kept = back.messages_and_choices[2]
    assert isinstance(kept, Choice) and isinstance(back.messages_and_choices[0], dict)
    assert kept.model_extra == {"token_ids": [5, 6, 151645], "prompt_token_ids": [1, 2, 3]}
    assert kept.logprobs.content[0].logprob == -0.25
    assert back.llm_calls[0].logprobs == [-0.1, -1e-9, -12.5]
    assert back.llm_calls[0].other_choices[0].token_ids == [9]
    assert back.additional_histories[0].llm_calls[0].completion_token_ids == [151643, 0, 7]
    assert back.to_json() == trajectory.to_json()


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trajectories = [rich_trajectory(), Trajectory(reward=-1.0)]
    path = write_jsonl(tmp_path / "a" / "0001.jsonl", trajectories)
    back = read_jsonl(path)
    assert [t.model_dump() for t in back] == [t.model_dump() for t in trajectories]
    assert len(path.read_text().splitlines()) == 2


def test_messages_turn_choices_into_assistant_dicts() -> None:
    messages = rich_trajectory().messages()
    assert messages[2] == {
        "role": "assistant",
        "content": "",  # ART's rule: content is never None (chat templates expect a string)
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }


def test_group_round_trip_and_from_mixed_items() -> None:
    group = TrajectoryGroup(
        [rich_trajectory(), rich_trajectory().model_dump(), ValueError("boom")], metadata={"k": 1}
    )
    assert len(group) == 2 and group.exceptions[0]["type"] == "ValueError"
    back = TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back.model_dump() == group.model_dump()


async def test_await_group_of_rollouts() -> None:
    with ScriptedServer(lambda r: Reply(content=str(len(r["messages"])))) as server:
        client = async_openai_client(server.base_url, "x", max_retries=0)

        async def rollout(i: int) -> Trajectory:
            async with capture() as trajectory:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": str(i)}]
                )
            trajectory.reward = float(i)
            return trajectory

        group = await art.TrajectoryGroup(rollout(i) for i in range(8))
    assert [t.reward for t in group] == [float(i) for i in range(8)]
    assert all(len(t.llm_calls) == 1 and t.messages()[-1]["content"] == "1" for t in group)
    assert group.pending == []


async def test_await_group_raises_on_failure() -> None:
    async def bad() -> Trajectory:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        await TrajectoryGroup([bad()])


def agent_script(request: dict) -> Reply:
    """An agent (2 tool turns, then an answer) with a summariser call in the middle."""
    first = request["messages"][0]["content"]
    if first == "summarise":
        return Reply(content="summary")
    turns = sum(1 for m in request["messages"] if m["role"] == "tool")
    if turns < 2:
        return Reply(tool_calls=[{"name": "search", "arguments": {"q": f"q{turns}"}, "id": f"t{turns}"}])
    return Reply(content="final answer")


def run_agent(summariser_last: bool = False) -> Trajectory:
    with ScriptedServer(agent_script) as server:
        client = openai_client(server.base_url, "x", request_token_ids=True, max_retries=0)
        with capture() as trajectory:
            messages: list[dict] = [{"role": "user", "content": "task"}]
            tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
            for turn in range(3):
                out = client.chat.completions.create(model="m", messages=messages, tools=tools)
                message = out.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if turn == 0 and not summariser_last:
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "summarise"}]
                    )
                for call in message.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "result"})
            if summariser_last:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "summarise"}])
    return trajectory


def test_finish_splits_conversations_and_builds_choices() -> None:
    trajectory = run_agent()
    assert len(trajectory.llm_calls) == 4  # the full ordered list
    assert trajectory.llm_calls[1].request["messages"][0]["content"] == "summarise"
    items = trajectory.messages_and_choices
    assert [type(i).__name__ for i in items] == ["dict", "Choice", "dict", "Choice", "dict", "Choice"]
    assert trajectory.messages()[-1]["content"] == "final answer"
    assert trajectory.tools[0]["function"]["name"] == "search"
    agent_calls = [c for c in trajectory.llm_calls if c.request["messages"][0]["content"] == "task"]
    for choice, call in zip([i for i in items if isinstance(i, Choice)], agent_calls, strict=True):
        assert choice.model_extra["token_ids"] == call.completion_token_ids
        assert choice.model_extra["prompt_token_ids"] == call.prompt_token_ids
        assert [e.logprob for e in choice.logprobs.content] == call.logprobs
    # each prompt extends the previous prompt + completion token for token (what training relies on)
    for prev, nxt in zip(agent_calls, agent_calls[1:], strict=False):
        assert nxt.prompt_token_ids[: len(prev.prompt_token_ids) + len(prev.completion_token_ids)] == (
            prev.prompt_token_ids + prev.completion_token_ids
        )
    (side,) = trajectory.additional_histories
    assert side.messages() == [
        {"role": "user", "content": "summarise"},
        {"role": "assistant", "content": "summary"},
    ]
    assert side.llm_calls == [trajectory.llm_calls[1]]
    assert side.llm_calls[0].prompt_token_ids == token_ids(
        prompt_text([{"role": "user", "content": "summarise"}], None)
    )


def test_main_conversation_policy() -> None:
    last = run_agent(summariser_last=True)
    assert last.messages()[-1]["content"] == "summary"  # "last": the conversation holding the last call
    assert last.additional_histories[0].messages()[-1]["content"] == "final answer"
    again = Trajectory(llm_calls=last.llm_calls)
    again.finish(main="most_calls")
    assert again.messages()[-1]["content"] == "final answer"
    assert again.additional_histories[0].messages()[-1]["content"] == "summary"


def test_finish_keeps_a_conversation_the_rollout_built() -> None:
    trajectory = run_agent()
    manual = Trajectory(
        messages_and_choices=[{"role": "user", "content": "mine"}], llm_calls=trajectory.llm_calls
    )
    manual.finish()
    assert manual.messages() == [{"role": "user", "content": "mine"}] and manual.additional_histories == []
    assert manual.end_time is not None


def test_reformatted_tool_arguments_still_continue_the_conversation() -> None:
    answer = {
        "index": 0,
        "finish_reason": "tool_calls",
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":1,"y":[1,2]}'}}
            ],
        },
    }
    first = LLMCall(request={"messages": [{"role": "user", "content": "u"}]}, response={"choices": [answer]})
    resent = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "other-id",
                "type": "function",
                "function": {"name": "f", "arguments": '{"y": [1, 2], "x": 1}'},
            }
        ],
    }
    second = LLMCall(
        request={
            "messages": [
                {"role": "user", "content": "u"},
                resent,
                {"role": "tool", "tool_call_id": "a", "content": "r"},
            ]
        },
        response={
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "done"}}
            ]
        },
    )
    trajectory = Trajectory(llm_calls=[first, second]).finish()
    assert trajectory.additional_histories == []
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    assert isinstance(trajectory.messages_and_choices[1], Choice)


def test_group_rejects_items_that_are_not_trajectories() -> None:
    with pytest.raises(TypeError, match="iterable of trajectories, not str"):
        TrajectoryGroup("nope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="item 1 is a int"):
        TrajectoryGroup([Trajectory(), 3])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        TrajectoryGroup.model_validate({"trajectories": "nope"})
