"""Replay fixtures from recordings providers write in their own ways: tool call ids reused every turn (`call_0`),
calls without ids, results out of order; and a recorded reward of 0.0 is a reward, not a missing one."""

from __future__ import annotations

import json
from typing import Any

from art_adapters.production import replay_scenarios
from art_adapters.trajectories import Trajectory


def ask(city: str, call_id: str | None) -> dict[str, Any]:
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": city})},
    }
    if call_id is not None:
        call["id"] = call_id
    return call


def result(content: str, call_id: str | None) -> dict[str, Any]:
    message = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def test_ids_reused_every_turn_replay_each_calls_own_result() -> None:
    messages = [
        {"role": "user", "content": "weather in Paris then Rome"},
        {"role": "assistant", "content": "", "tool_calls": [ask("Paris", "call_0")]},
        result("Paris: 12C rain", "call_0"),
        {"role": "assistant", "content": "", "tool_calls": [ask("Rome", "call_0")]},
        result("Rome: 25C sun", "call_0"),
        {"role": "assistant", "content": "Paris 12C, Rome 25C"},
    ]
    (scenario,) = replay_scenarios([Trajectory(messages_and_choices=messages, reward=1.0)])
    assert scenario.tool_result("weather", {"city": "Paris"}) == "Paris: 12C rain"
    assert scenario.tool_result("weather", {"city": "Rome"}) == "Rome: 25C sun"


def test_calls_without_ids_replay_by_position() -> None:
    messages = [
        {"role": "user", "content": "weather in Paris and Rome"},
        {"role": "assistant", "content": "", "tool_calls": [ask("Paris", None), ask("Rome", None)]},
        result("Paris: 12C rain", None),
        result("Rome: 25C sun", None),
        {"role": "assistant", "content": "", "tool_calls": [ask("Oslo", None)]},
        result("Oslo: -3C snow", None),
        {"role": "assistant", "content": "done"},
    ]
    (scenario,) = replay_scenarios([Trajectory(messages_and_choices=messages, reward=1.0)])
    assert scenario.tool_result("weather", {"city": "Paris"}) == "Paris: 12C rain"
    assert scenario.tool_result("weather", {"city": "Rome"}) == "Rome: 25C sun"
    assert scenario.tool_result("weather", {"city": "Oslo"}) == "Oslo: -3C snow"


def test_results_out_of_order_follow_their_ids_and_a_same_turn_duplicate_id_falls_back_to_position() -> None:
    messages = [
        {"role": "user", "content": "three cities"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [ask("Paris", "a"), ask("Rome", "b"), ask("Oslo", "dup"), ask("Kyiv", "dup")],
        },
        result("Rome: 25C sun", "b"),
        result("Paris: 12C rain", "a"),
        result("Oslo: -3C snow", "dup"),
        result("Kyiv: 5C cloud", "dup"),
        {"role": "assistant", "content": "done"},
    ]
    (scenario,) = replay_scenarios([Trajectory(messages_and_choices=messages, reward=1.0)])
    assert scenario.tool_result("weather", {"city": "Paris"}) == "Paris: 12C rain"
    assert scenario.tool_result("weather", {"city": "Rome"}) == "Rome: 25C sun"
    assert scenario.tool_result("weather", {"city": "Oslo"}) == "Oslo: -3C snow"
    assert scenario.tool_result("weather", {"city": "Kyiv"}) == "Kyiv: 5C cloud"


def test_a_call_never_answered_has_no_fixture() -> None:
    messages = [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": "", "tool_calls": [ask("Paris", "call_0")]},
        {"role": "assistant", "content": "", "tool_calls": [ask("Rome", "call_0")]},
        result("Rome: 25C sun", "call_0"),
        {"role": "assistant", "content": "done"},
    ]
    (scenario,) = replay_scenarios([Trajectory(messages_and_choices=messages, reward=1.0)])
    assert scenario.tool_result("weather", {"city": "Paris"}) == scenario.unknown_result
    assert scenario.tool_result("weather", {"city": "Rome"}) == "Rome: 25C sun"


def test_a_zero_reward_is_a_reward() -> None:
    start = [{"role": "user", "content": "q"}]
    decent = Trajectory(messages_and_choices=[*start, {"role": "assistant", "content": "decent"}], reward=0.0)
    worse = Trajectory(
        messages_and_choices=[*start, {"role": "assistant", "content": "terrible"}], reward=-1.0
    )
    (scenario,) = replay_scenarios([decent, worse])
    assert scenario.recorded_answer == "decent" and scenario.recorded_reward == 0.0
    better = Trajectory(messages_and_choices=[*start, {"role": "assistant", "content": "good"}], reward=0.5)
    (scenario,) = replay_scenarios([decent, worse, better])
    assert scenario.recorded_answer == "good" and scenario.recorded_reward == 0.5
