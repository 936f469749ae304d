"""Split captured calls into conversations: a call continues one when its messages extend that one's messages + answer.

Used by `Trajectory.finish()` when a rollout did not build its conversation itself.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from .calls import LLMCall, Message, Tools
from .history import History, MessageOrChoice
from .sources import SplitBy

Key = tuple[Any, ...]


def _arguments_key(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, default=str)


def _content_key(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(json.dumps(part, sort_keys=True, default=str))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, default=str)


def message_key(message: Message) -> Key:
    """What must match for two messages to be the same turn (formatting of JSON arguments and ids ignored).

    An assistant turn's `name` is ignored: agents built with a name (LangChain's `create_agent(name=...)`, which
    supervisor and swarm libraries require) get each answer echoed back under that name, while the engine's
    answer carries none; it is the same turn."""
    calls = tuple(
        (
            str((c.get("function") or {}).get("name", "")),
            _arguments_key((c.get("function") or {}).get("arguments", "")),
        )
        for c in message.get("tool_calls") or []
    )
    role = message.get("role")
    name = None if role == "assistant" else message.get("name")
    return (role, _content_key(message.get("content")), calls, name)


def tools_key(call: LLMCall) -> str:
    """The call's tool definitions, canonical: calls offered different tools saw different prompts."""
    return json.dumps(call.request_tools() or None, sort_keys=True, default=str)


class Conversation:
    """Calls chained by extension under the same tools; `picked[i]` is the choice index of call i that the next
    call continued. A call offered other tools starts a conversation of its own (its prompt rendered differently:
    chaining it would train on a prompt the model never saw)."""

    __slots__ = ("calls", "picked", "keys", "tools")

    def __init__(self, call: LLMCall, keys: list[Key], tools: str = "") -> None:
        self.calls = [call]
        self.picked = [0]
        self.keys = keys
        self.tools = tools  # tools_key(call); a conversation no other call is matched against needs none

    def match(self, keys: list[Key], tools: str) -> tuple[int, int] | None:
        """(matched length, choice index) if `keys` extend this conversation's last messages + one of its answers."""
        last = self.calls[-1]
        n = len(self.keys)
        if tools != self.tools or len(keys) <= n or keys[:n] != self.keys:
            return None
        for choice in last.choices():
            message = choice.get("message")
            if isinstance(message, dict) and message_key(message) == keys[n]:
                return n + 1, int(choice.get("index", 0))
        return None

    def add(self, call: LLMCall, keys: list[Key], picked: int) -> None:
        self.picked[-1] = picked
        self.calls.append(call)
        self.picked.append(0)
        self.keys = keys

    def messages_and_choices(self) -> tuple[list[MessageOrChoice], Tools | None]:
        """The last call's messages, with earlier calls' answers (and the last answer) as Choices carrying ids."""
        last = self.calls[-1]
        items: list[MessageOrChoice] = list(last.request_messages())
        for call, picked in zip(self.calls[:-1], self.picked[:-1], strict=True):
            position = len(call.request_messages())
            if position < len(items):
                items[position] = choice_of(call, picked) or items[position]
        answer = choice_of(last, self.picked[-1])
        if answer is not None:
            items.append(answer)
        return items, last.request_tools()


def choice_of(call: LLMCall, index: int = 0) -> MessageOrChoice | None:
    """Choice `index` of the call as an openai Choice with `prompt_token_ids` / `token_ids` extras (the message dict
    if the server's choice is not a valid Choice)."""
    for choice in call.choices():
        if choice.get("index", 0) != index:
            continue
        data = dict(choice)
        if data.get("finish_reason") is None:  # a stream that ended without one (the record keeps None)
            data["finish_reason"] = "stop"
        if call.prompt_token_ids is not None and "prompt_token_ids" not in data:
            data["prompt_token_ids"] = call.prompt_token_ids
        if call.api == "responses" and call.completion_token_ids is not None:
            data.setdefault("token_ids", call.completion_token_ids)
        if call.policy_version is not None:
            data.setdefault("policy_version", call.policy_version)
            data.setdefault("policy_token_spans", call.policy_token_spans(index))
            if call.served_model:
                data.setdefault(
                    "served_model", call.served_model
                )  # whose version it is (spans of 0 tokens are none)
        try:
            return Choice.model_validate(data)
        except ValidationError:
            return call.response_message(index)
    return None


def split_conversations(calls: list[LLMCall]) -> list[Conversation]:
    """Group answered calls into conversations, in order of their first call (unanswered calls are left out)."""
    answered = [call for call in calls if not call.error and call.choices()]
    if len(answered) == 1:  # the common single-call rollout: nothing to chain, no keys to compute
        return [Conversation(answered[0], [])]
    conversations: list[Conversation] = []
    for call in answered:
        keys = [message_key(m) for m in call.request_messages() if isinstance(m, dict)]
        tools = tools_key(call)
        best: tuple[int, int, Conversation] | None = None
        for conversation in conversations:
            found = conversation.match(keys, tools)
            if found is not None and (best is None or found[0] >= best[0]):
                best = (found[0], found[1], conversation)
        if best is None:
            conversations.append(Conversation(call, keys, tools))
        else:
            best[2].add(call, keys, best[1])
    return conversations


def main_index(conversations: list[Conversation], calls: list[LLMCall], policy: str = "last") -> int:
    """The main conversation: the one holding the last answered call ("last"), the one with most calls, or the
    one the first call opened ("first", ART's auto-capture rule)."""
    if policy == "first":
        return 0
    if policy == "most_calls":
        return max(range(len(conversations)), key=lambda i: (len(conversations[i].calls), i))
    if policy != "last":
        raise ValueError(f"main must be 'first', 'last' or 'most_calls', not {policy!r}")
    owner = {id(call): i for i, conv in enumerate(conversations) for call in conv.calls}
    for call in reversed(calls):
        if id(call) in owner:
            return owner[id(call)]
    return len(conversations) - 1


def grouped_calls(calls: list[LLMCall], by: SplitBy) -> dict[str | None, list[LLMCall]]:
    """The calls grouped by `call.source.key(by)`, groups in order of their first call."""
    groups: dict[str | None, list[LLMCall]] = {}
    for call in calls:
        groups.setdefault(call.source.key(by), []).append(call)
    return groups


def conversations_by(calls: list[LLMCall], by: SplitBy | None) -> list[Conversation]:
    """`split_conversations`, first splitting the calls by source (`by`) so no conversation mixes two groups."""
    if by is None:
        return split_conversations(calls)
    return [c for group in grouped_calls(calls, by).values() for c in split_conversations(group)]


def histories_by(calls: list[LLMCall], by: SplitBy) -> dict[str | None, list[History]]:
    """Per group (node, agent or role), its conversations as Histories (answers as Choices carrying ids)."""
    out: dict[str | None, list[History]] = {}
    for key, group in grouped_calls(calls, by).items():
        histories = []
        for conversation in split_conversations(group):
            items, tools = conversation.messages_and_choices()
            histories.append(
                History(messages_and_choices=items, tools=tools, llm_calls=list(conversation.calls))
            )
        out[key] = histories
    return out
