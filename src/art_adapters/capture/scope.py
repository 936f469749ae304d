"""The capture scope: a context variable naming the Trajectory that LLM calls made here are recorded into."""

from __future__ import annotations

import hashlib
from contextvars import ContextVar, Token
from types import TracebackType

from ..calls import LLMCall, check_call_reward
from ..sources import SplitBy
from ..trajectories import Trajectory
from .frameworks import disable_langchain_sources, enable_langchain_sources

CURRENT: ContextVar[Trajectory | None] = ContextVar("art_adapters_capture", default=None)


def rollout_key(trajectory: Trajectory) -> str:
    """An opaque key naming one trajectory while it lives (nothing of its content), sent to our backend with each
    of its calls so they all reach the same engine (its prefix cache)."""
    raw = f"{id(trajectory)}:{trajectory.start_time}"
    return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()


def current_trajectory(*, required: bool = False) -> Trajectory | None:
    """The Trajectory of the innermost open scope in this context (`capture()`, `wrap_rollout`, `with
    art.Trajectory()`); None outside any, or RuntimeError with `required=True`."""
    trajectory = CURRENT.get()
    if trajectory is None and required:
        raise RuntimeError(
            "no trajectory scope is open here: use `with art.Trajectory():` or art.trajectory(...)"
        )
    return trajectory


class capture:  # noqa: N801 - used like a function: `with capture() as trajectory:`
    """Record every OpenAI-compatible call made through a recording client into one Trajectory.

        async with art.capture() as trajectory:
            await agent.ainvoke(...)
        trajectory.reward = score(trajectory)

    Works as `with` and `async with`. The scope is a ContextVar, so concurrent rollouts (tasks) never mix; tasks
    started inside inherit it; in nested scopes the inner one wins. On exit `trajectory.finish()` builds the
    conversation from the calls if the rollout did not (`split_by`: see `Trajectory.finish`).
    """

    __slots__ = ("trajectory", "split_by", "_tokens", "_sources")

    def __init__(self, trajectory: Trajectory | None = None, *, split_by: SplitBy | None = None) -> None:
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.split_by = split_by
        self._tokens: list[Token[Trajectory | None]] = []
        self._sources: list[object] = []

    def __enter__(self) -> Trajectory:
        self._tokens.append(CURRENT.set(self.trajectory))
        self._sources.append(enable_langchain_sources())
        self.trajectory._sealed = False
        return self.trajectory

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        CURRENT.reset(self._tokens.pop())
        disable_langchain_sources(self._sources.pop())
        self.trajectory._sealed = True  # a call still in flight (a task that outlived the scope) is dropped
        self.trajectory.finish(split_by=self.split_by)

    async def __aenter__(self) -> Trajectory:
        return self.__enter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(kind, error, tb)


def reward_call(value: float, call: int | LLMCall | None = None) -> LLMCall:
    """Give one call of the current scope's trajectory its own reward (a turn's reward) and return that call: the
    last call recorded so far (`call=None`), the call at index `call` of `trajectory.llm_calls` (negative counts
    from the end), or that `LLMCall` itself. A reward that is not a finite number, a scope with no call yet, an
    index past its calls or a call of another trajectory is a ValueError (IndexError for the index); nothing is
    changed then. How call rewards combine with the trajectory's reward: docs/training.md, 'Credit per turn'."""
    reward = check_call_reward(value)
    if reward is None:
        raise ValueError("reward_call takes a finite number, not None")
    trajectory = current_trajectory(required=True)
    assert trajectory is not None
    calls = trajectory.llm_calls
    if call is None:
        if not calls:
            raise ValueError(
                "reward_call: the current trajectory has no call yet (reward after the call returns)"
            )
        target = calls[-1]
    elif isinstance(call, LLMCall):
        if not any(c is call for c in calls):
            raise ValueError("reward_call: that call is not one of the current trajectory's calls")
        target = call
    elif isinstance(call, int) and not isinstance(call, bool):
        if not -len(calls) <= call < len(calls):
            raise IndexError(
                f"reward_call: no call {call}; the current trajectory has {len(calls)} call(s) "
                f"(indices 0..{len(calls) - 1})"
            )
        target = calls[call]
    else:
        raise TypeError(f"reward_call's call is an index, an LLMCall or None, not {type(call).__name__}")
    target.reward = reward
    return target
