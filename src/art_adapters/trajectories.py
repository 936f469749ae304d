"""The data contract: trajectories, their histories and the LLM calls captured into them (ART's shape)."""

from __future__ import annotations

import copy
import inspect
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from .calls import LLMCall, Message, Tools
from .calls import SampledChoice as SampledChoice  # re-exported: its home before calls.py
from .conversations import conversations_by, histories_by, main_index
from .history import History as History
from .history import LegacyHistory as LegacyHistory
from .history import MainPolicy as MainPolicy
from .history import MessageOrChoice as MessageOrChoice
from .history import Messages as Messages
from .history import MessagesAndChoices as MessagesAndChoices
from .history import MetadataValue as MetadataValue
from .history import PydanticException as PydanticException
from .history import Tokenizer as Tokenizer
from .history import get_messages as get_messages
from .history import messages_of as messages_of
from .sources import SplitBy
from .tokenized import (
    TokenizedMultiHistoryTrajectory,
    TokenizedTrajectory,
    TokenizedTrajectoryGroup,
    tokenize_group,
    tokenize_trajectory,
)

REWARD_MISSING = "reward_missing"  # metadata flag: the reward field holds a 0.0 placeholder, no reward came


def reward_missing(trajectory: Trajectory) -> bool:
    """Whether the trajectory came without a reward (an imported trace no score or attribute rewarded): flagged
    `metadata["reward_missing"] = True`, its `reward` a 0.0 placeholder. Groupings and the trainer skip and count
    it; assigning `trajectory.reward` gives it one (the flag goes)."""
    return trajectory.metadata.get(REWARD_MISSING) is True


def check_missing_reward(value: object) -> None:
    """An importer's `missing_reward=`: None (flag the trajectory `reward_missing`) or a finite number; anything
    else (NaN, an infinity, a string) is refused before anything is read."""
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ):
        raise ValueError(f"missing_reward is a finite number or None, not {value!r}")


class Trajectory(BaseModel):
    """One rollout: the conversation, every captured LLM call, and its reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True, ser_json_inf_nan="constants")

    messages_and_choices: MessagesAndChoices = Field(default_factory=list)
    tools: Tools | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    rewards_by_role: dict[str, float] = Field(default_factory=dict)
    initial_policy_version: int | None = Field(
        None,
        description="The oldest policy version that sampled it (the async pipeline stamps it when unset).",
    )
    final_policy_version: int | None = Field(None, description="The newest policy version that sampled it.")
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    llm_calls: list[LLMCall] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    _scope: AbstractContextManager[Any] | None = PrivateAttr(default=None)
    _sealed: bool = PrivateAttr(default=False)  # its capture scope closed: late calls are not added

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "reward":  # a reward given: no longer missing (see `reward_missing`)
            self.metadata.pop(REWARD_MISSING, None)

    def messages(self) -> list[Message]:
        """The conversation as OpenAI-format message dicts (Choices become assistant messages; content is never
        None, as chat templates expect)."""
        return messages_of(self.messages_and_choices)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Add the seconds spent inside to `metrics[f"{metric_name}_duration"]`."""
        started = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = float(self.metrics.get(key, 0.0)) + time.monotonic() - started

    def for_logging(self) -> dict[str, Any]:
        """A JSON-ready summary: reward, versions, metrics, metadata, tools, logs, and the messages, each marked
        `trainable` when it is a sampled Choice."""
        messages = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                messages.append(
                    {**item.message.model_dump(mode="json", exclude_none=True), "trainable": True}
                )
            else:
                messages.append({**dict(item), "trainable": False})
        return {
            "reward": self.reward,
            "initial_policy_version": self.initial_policy_version,
            "final_policy_version": self.final_policy_version,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "messages": messages,
            "tools": self.tools,
            "logs": list(self.logs),
        }

    def __enter__(self) -> Trajectory:
        """`with art.Trajectory() as t:` records every chat completion made inside into `t` (ART main's scope)."""
        return rollout_scopes().enter_trajectory(self)

    def __exit__(self, *exc_info: Any) -> None:
        rollout_scopes().exit_trajectory(self, *exc_info)

    def histories(self, by: SplitBy = "role") -> dict[str | None, list[History]]:
        """The captured calls grouped by where they came from (`"node"`, `"agent"` or `"role"`, see
        `CallSource.key`), each group's conversations as Histories; key None holds calls with no such source."""
        return histories_by(self.llm_calls, by)

    def finish(self, main: MainPolicy = "last", split_by: SplitBy | None = None) -> Trajectory:
        """Build the conversation from the captured calls if the rollout did not, and stamp the end.

        Calls are chained into conversations (a call continues one when its messages extend that one's last
        messages + answer). The main one, `main="last"`: the one holding the last answered call (the agent's final
        answer), or `"most_calls"`; the others (sub-agents, summarisers) become `additional_histories`. Answers
        become openai Choices carrying `prompt_token_ids` / `token_ids` / logprobs. `llm_calls` stays the full list.
        `split_by` ("node", "agent", "role"): no conversation mixes calls of two groups (a handoff then starts a
        new history). The main one is then the group holding the chosen call.
        """
        if not self.messages_and_choices and self.llm_calls:
            conversations = conversations_by(self.llm_calls, split_by)
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
        self.metrics["duration"] = self.end_time - self.start_time
        return self

    def tokenize(
        self,
        *,
        multi_history: bool = False,
        reconcile_text_equivalent_tokenizations: bool = False,
        model: str | None = None,
        base_model: str | None = None,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> TokenizedTrajectory | TokenizedMultiHistoryTrajectory:
        """ART's `Trajectory.tokenize()` (PR #773): its history's token ids, sampled logprobs (NaN where none) and
        `TokenFlag`s (EXACT: the engine's id; SAMPLED: a sampled response token). `tokenizer`, or `base_model`
        to load one; `multi_history=True` returns every history (a later prompt that does not extend the tokens
        sampled before it starts a new one, unless `reconcile_text_equivalent_tokenizations` and it differs only
        in how the same text is tokenized: ART PR #782)."""
        return tokenize_trajectory(
            self,
            multi_history=multi_history,
            reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.model_validate_json(text)


class TrajectoryGroup(BaseModel):
    """Trajectories of one scenario, compared with each other for the advantage.

    Built from trajectories, or from awaitables of them; then the group itself is awaitable:
    `group = await art.TrajectoryGroup(rollout(model, s) for _ in range(8))`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, ser_json_inf_nan="constants")

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory] | BaseException] = (),
        *,
        exceptions: Iterable[BaseException | PydanticException | dict[str, str]] | None = None,
        metadata: dict[str, MetadataValue] | None = None,
        **data: Any,
    ) -> None:
        if isinstance(trajectories, str | bytes | dict | BaseModel):
            raise TypeError(
                f"TrajectoryGroup takes an iterable of trajectories, not {type(trajectories).__name__}"
            )
        done: list[Trajectory] = []
        pending: list[Awaitable[Trajectory]] = []
        errors = [exception_record(e) if isinstance(e, BaseException) else e for e in exceptions or ()]
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

    def log(self, message: str) -> None:
        self.logs.append(message)

    def __copy__(self) -> TrajectoryGroup:
        """A new group with its own lists and dicts (the trajectories themselves are shared)."""
        group = type(self).model_construct(
            trajectories=list(self.trajectories),
            exceptions=list(self.exceptions),
            metadata=dict(self.metadata),
            metrics=dict(self.metrics),
            logs=list(self.logs),
        )
        group._pending = list(self._pending)
        return group

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> TrajectoryGroup:
        group = type(self).model_construct(
            **{name: copy.deepcopy(getattr(self, name), memo) for name in type(self).model_fields}
        )
        group._pending = []
        return group

    def __enter__(self) -> TrajectoryGroup:
        """`with art.TrajectoryGroup() as g:` collects each `with art.Trajectory()` that closes inside."""
        return rollout_scopes().enter_group(self)

    def __exit__(self, *exc_info: Any) -> None:
        rollout_scopes().exit_group(self)

    def tokenize(
        self,
        *,
        multi_history: bool = False,
        reconcile_text_equivalent_tokenizations: bool = False,
        model: str | None = None,
        base_model: str | None = None,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> TokenizedTrajectoryGroup[Any]:
        """ART's `TrajectoryGroup.tokenize()`: each trajectory's `tokenize()` with the same settings."""
        return tokenize_group(
            self,
            multi_history=multi_history,
            reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        """Run the pending rollouts (any failure raises; use `gather_trajectory_groups` to tolerate some)."""
        return rollout_scopes().gather(self).__await__()


class RolloutError(RuntimeError):
    """A rollout returned something other than a Trajectory."""


def exception_record(error: BaseException) -> PydanticException:
    return PydanticException.of(error)


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


# ---- the behaviour the layers above give these objects ------------------------------------------------------------


class RolloutScopes(Protocol):
    """What `with Trajectory()`, `with TrajectoryGroup()` and `await TrajectoryGroup(...)` do: capture scopes and
    gathering, which live above the data contract. The contract names them here; `art_adapters` (its package
    initialiser, the composition root) provides them from `adapters/rollout_scope.py`, so this module imports
    nothing above it. `names`: ART main's scope functions, also importable from here."""

    names: dict[str, Any]

    def enter_trajectory(self, trajectory: Trajectory) -> Trajectory: ...
    def exit_trajectory(self, trajectory: Trajectory, *exc_info: Any) -> None: ...
    def enter_group(self, group: TrajectoryGroup) -> TrajectoryGroup: ...
    def exit_group(self, group: TrajectoryGroup) -> None: ...
    def gather(self, group: TrajectoryGroup) -> Awaitable[TrajectoryGroup]: ...


_scopes: list[RolloutScopes] = []


def provide_rollout_scopes(scopes: RolloutScopes) -> None:
    """Give trajectories their scopes (called once, by `art_adapters/__init__.py`)."""
    _scopes[:] = [scopes]


def rollout_scopes() -> RolloutScopes:
    if not _scopes:
        raise RuntimeError(
            "rollout scopes are provided by the art_adapters package: import art_adapters first"
        )
    return _scopes[0]


def __getattr__(name: str) -> Any:
    """ART main's scope functions, also importable from here (`from art.trajectories import trajectory`)."""
    if _scopes and name in _scopes[0].names:
        return _scopes[0].names[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
