"""The conversation data the contract is made of: messages and Choices, a History (a conversation beside the main
one), and a rollout's exception as data."""

from __future__ import annotations

import traceback
from typing import Annotated, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field

from .calls import LLMCall, Message, Tools

Messages = list[Message]
MessageOrChoice = Annotated[Choice | Message, Field(union_mode="left_to_right")]
MessagesAndChoices = list[MessageOrChoice]
MetadataValue = float | int | str | bool | None
MainPolicy = Literal["first", "last", "most_calls"]


class PydanticException(BaseModel):
    """A rollout's exception as data (JSON-safe): its type name, message and formatted traceback."""

    type: str
    message: str
    traceback: str = ""

    def __getitem__(self, key: str) -> str:  # dict-style access, as the JSON form reads
        return str(getattr(self, key))

    @classmethod
    def of(cls, error: BaseException) -> PydanticException:
        return cls(
            type=type(error).__name__,
            message=str(error),
            traceback="".join(traceback.format_exception(error)),
        )


class History(BaseModel):
    """A conversation that does not extend the main one (a sub-agent, a summariser)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, ser_json_inf_nan="constants")

    messages_and_choices: MessagesAndChoices = Field(default_factory=list)
    tools: Tools | None = None
    llm_calls: list[LLMCall] = Field(default_factory=list)

    def messages(self) -> list[Message]:
        return messages_of(self.messages_and_choices)


def messages_of(items: MessagesAndChoices) -> list[Message]:
    """Message dicts of a conversation: Choices as assistant messages, and `content: None` as "" (ART's rule)."""
    out: list[Message] = []
    for item in items:
        if isinstance(item, Choice):
            message = item.message.model_dump(exclude_none=True, exclude_unset=False)
            message = {k: v for k, v in message.items() if k in _MESSAGE_KEYS}
        else:
            message = dict(item)
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


get_messages = messages_of  # ART's name


_MESSAGE_KEYS = {"role", "content", "tool_calls", "name", "refusal", "function_call"}
