"""The data contract: trajectories, their histories and the LLM calls captured into them (ART's shape)."""

from __future__ import annotations

import inspect
import json
import time
import traceback
from collections.abc import Awaitable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

Message = dict[str, Any]
MessageOrChoice = Annotated[Choice | Message, Field(union_mode="left_to_right")]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]
MetadataValue = float | int | str | bool | None


class SampledChoice(BaseModel):
    """Token ids and logprobs the engine sampled for one choice of a call (choices after the first when n > 1)."""

    index: int
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None


class LLMCall(BaseModel):
    """One OpenAI-compatible exchange as the recording client saw it."""

    request: dict[str, Any]
    response: dict[str, Any] | None = None
    url: str = ""
    status_code: int | None = None
    stream: bool = False
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    other_choices: list[SampledChoice] = Field(default_factory=list)
    logprobs_mode: str | None = None
    started_at: float = Field(default_factory=time.time)
    latency_s: float = 0.0
    error: str | None = None

    @property
    def ended_at(self) -> float:
        return self.started_at + self.latency_s

    @property
    def model(self) -> str | None:
        return self.request.get("model")

    def request_messages(self) -> list[Message]:
        return list(self.request.get("messages") or [])

    def response_message(self, index: int = 0) -> Message | None:
        """The assistant message of choice `index`, as a request-ready dict (None if the call failed)."""
        if not self.response:
            return None
        for choice in self.response.get("choices") or []:
            if choice.get("index", 0) == index:
                message = dict(choice.get("message") or {})
                return {k: v for k, v in message.items() if v is not None}
        return None


class History(BaseModel):
    """A conversation that does not extend the main one (a sub-agent, a summariser)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: MessagesAndChoices = Field(default_factory=list)
    tools: Tools | None = None
    llm_calls: list[LLMCall] = Field(default_factory=list)

    def messages(self) -> list[Message]:
        return messages_of(self.messages_and_choices)


class Trajectory(BaseModel):
    """One rollout: the conversation, every captured LLM call, and its reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: MessagesAndChoices = Field(default_factory=list)
    tools: Tools | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    llm_calls: list[LLMCall] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None

    def messages(self) -> list[Message]:
        """The conversation as OpenAI-format message dicts (Choices become assistant messages)."""
        return messages_of(self.messages_and_choices)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self, main: Literal["last", "most_calls"] = "last") -> Trajectory:
        """Build the conversation from the captured calls if the rollout did not, and stamp the end.

        Calls are chained into conversations (a call continues one when its messages extend that one's last
        messages + answer). The main one, `main="last"`: the one holding the last answered call (the agent's final
        answer), or `"most_calls"`; the others (sub-agents, summarisers) become `additional_histories`. Answers
        become openai Choices carrying `prompt_token_ids` / `token_ids` / logprobs. `llm_calls` stays the full list.
        """
        if not self.messages_and_choices and self.llm_calls:
            from .capture.conversations import main_index, split_conversations

            conversations = split_conversations(self.llm_calls)
            if conversations:
                index = main_index(conversations, self.llm_calls, main)
                self.messages_and_choices, self.tools = conversations[index].messages_and_choices()
                for i, conversation in enumerate(conversations):
                    if i != index:
                        items, tools = conversation.messages_and_choices()
                        self.additional_histories.append(
                            History(
                                messages_and_choices=items, tools=tools, llm_calls=list(conversation.calls)
                            )
                        )
        self.end_time = self.end_time or time.time()
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.model_validate_json(text)


def messages_of(items: MessagesAndChoices) -> list[Message]:
    out: list[Message] = []
    for item in items:
        if isinstance(item, Choice):
            message = item.message.model_dump(exclude_none=True, exclude_unset=False)
            out.append({k: v for k, v in message.items() if k in _MESSAGE_KEYS})
        else:
            out.append(dict(item))
    return out


_MESSAGE_KEYS = {"role", "content", "tool_calls", "name", "refusal", "function_call"}


class TrajectoryGroup(BaseModel):
    """Trajectories of one scenario, compared with each other for the advantage.

    Built from trajectories, or from awaitables of them; then the group itself is awaitable:
    `group = await art.TrajectoryGroup(rollout(model, s) for _ in range(8))`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[dict[str, str]] = Field(default_factory=list)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory] | BaseException] = (),
        *,
        exceptions: list[dict[str, str]] | None = None,
        metadata: dict[str, MetadataValue] | None = None,
        **data: Any,
    ) -> None:
        if isinstance(trajectories, str | bytes | dict | BaseModel):
            raise TypeError(
                f"TrajectoryGroup takes an iterable of trajectories, not {type(trajectories).__name__}"
            )
        done: list[Trajectory] = []
        pending: list[Awaitable[Trajectory]] = []
        errors = list(exceptions or [])
        for index, item in enumerate(trajectories):
            if isinstance(item, Trajectory):
                done.append(item)
            elif isinstance(item, BaseException):
                errors.append(exception_record(item))
            elif isinstance(item, dict):
                done.append(Trajectory.model_validate(item))
            elif inspect.isawaitable(item):
                pending.append(item)
            else:
                raise TypeError(
                    f"TrajectoryGroup item {index} is a {type(item).__name__}: expected a Trajectory, "
                    "a Trajectory dict or an awaitable of one"
                )
        super().__init__(trajectories=done, exceptions=errors, metadata=metadata or {}, **data)
        self._pending = pending

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def pending(self) -> list[Awaitable[Trajectory]]:
        return self._pending

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        """Run the pending rollouts (any failure raises; use `gather_trajectory_groups` to tolerate some)."""
        from .gather import gather_trajectory_groups

        async def run() -> TrajectoryGroup:
            groups = await gather_trajectory_groups([self], pbar_desc=None)
            return groups[0]

        return run().__await__()


class RolloutError(RuntimeError):
    """A rollout returned something other than a Trajectory."""


def exception_record(error: BaseException) -> dict[str, str]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for trajectory in trajectories:
            f.write(trajectory.model_dump_json() + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Trajectory]:
    with Path(path).open() as f:
        return [Trajectory.model_validate_json(line) for line in f if line.strip()]


def dumps_group(group: TrajectoryGroup) -> str:
    return json.dumps(group.model_dump(mode="json"))
