"""The conversation data the contract is made of: messages and Choices, a History (a conversation beside the main
one), and a rollout's exception as data."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field

from .calls import LLMCall, Message, Tools
from .tokenized import TokenizedHistory, history_tokenizer

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

    def tokenize(
        self,
        *,
        model: str | None = None,
        base_model: str | None = None,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        reconcile_text_equivalent_tokenizations: bool = False,
    ) -> TokenizedHistory:
        """ART's `LegacyHistory.tokenize()`: this history as one token sequence (see `Trajectory.tokenize`)."""
        histories = history_tokenizer()(
            self,
            reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        if len(histories) != 1:
            raise ValueError(
                f"the history tokenizes into {len(histories)} sequences (a later prompt does not extend the tokens "
                "sampled before it): use Trajectory.tokenize(multi_history=True), or "
                "reconcile_text_equivalent_tokenizations=True where only the tokenization of the same text differs"
            )
        return histories[0]


LegacyHistory = History  # ART's name for a `messages_and_choices` history (`art.trajectories.LegacyHistory`)


class Tokenizer(Protocol):
    """What ART's `tokenize(tokenizer=...)` needs of a tokenizer (a Hugging Face tokenizer has it)."""

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> object: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: list[int]) -> str: ...


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
