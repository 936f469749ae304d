"""Tool environments: a Scenario, a ToolSet (OpenAI tool schemas + python callables) and a verifiable reward."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import sqlite3
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, Field

ToolFn = Callable[..., Any] | Callable[..., Awaitable[Any]]


class Scenario(BaseModel):
    """One task: the question the agent gets, and the answer its reward is checked against."""

    id: str
    question: str
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


@dataclass
class Tool:
    """A tool the agent may call: a name, a description, a JSON schema for its arguments, and the function."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn

    def schema(self) -> dict[str, Any]:
        """The OpenAI chat-completions tool schema."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolSet:
    """Tools by name; `schemas` go to the model, `functions` to the tool loop, `call` runs one safely."""

    tools: list[Tool] = field(default_factory=list)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools]

    @property
    def functions(self) -> dict[str, ToolFn]:
        return {tool.name: tool.fn for tool in self.tools}

    async def call(self, name: str, arguments: str | Mapping[str, Any] | None) -> str:
        return await call_tool(self.functions, name, arguments)

    def as_langchain_tools(self) -> list[Any]:
        """The tools as LangChain `StructuredTool`s (imports langchain-core)."""
        from langchain_core.tools import StructuredTool

        out = []
        for tool in self.tools:
            fn = tool.fn
            is_async = inspect.iscoroutinefunction(fn)
            out.append(
                StructuredTool.from_function(
                    func=None if is_async else fn,
                    coroutine=fn if is_async else None,
                    name=tool.name,
                    description=tool.description,
                    args_schema=tool.parameters,
                )
            )
        return out


class Environment(Protocol):
    """What an environment offers a rollout."""

    def scenarios(self, split: str = "train") -> list[Scenario]: ...

    def tools(self) -> ToolSet: ...

    def reward(self, scenario: Scenario, answer: Any) -> float: ...


class ToolError(Exception):
    """A tool call the model got wrong; its message goes back to the model."""


def parse_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Tool-call arguments as a dict; bad JSON or a non-object raises ToolError."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, TypeError) as error:
        raise ToolError(
            f"arguments are not valid JSON ({error.msg if hasattr(error, 'msg') else error})"
        ) from None
    if not isinstance(value, dict):
        raise ToolError(f"arguments must be a JSON object, got {type(value).__name__}")
    return value


async def call_tool(
    functions: Mapping[str, ToolFn], name: str, arguments: str | Mapping[str, Any] | None
) -> str:
    """Run one tool call; every failure (bad JSON, unknown tool, wrong arguments, a raise) is an error string."""
    try:
        fn = functions.get(name)
        if fn is None:
            known = ", ".join(sorted(functions)) or "none"
            raise ToolError(f"unknown tool {name!r} (tools: {known})")
        kwargs = parse_arguments(arguments)
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as error:
            raise ToolError(f"wrong arguments for {name}: {error}") from None
        except ValueError:
            pass  # no introspectable signature (a builtin); let the call decide
        if inspect.iscoroutinefunction(fn):
            result = await fn(**kwargs)
        else:
            result = await _call_sync(fn, kwargs)
            if inspect.isawaitable(result):
                result = await result
        return result if isinstance(result, str) else json.dumps(result, default=str)
    except ToolError as error:
        return f"Error: {error}"
    except asyncio.CancelledError:
        raise
    except Exception as error:
        return f"Error: {name} raised {type(error).__name__}: {error}"


_THREAD_BOUND: weakref.WeakSet[Any] = weakref.WeakSet()  # sync tools whose objects live in the loop's thread


async def _call_sync(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """A sync tool runs in a worker thread, so a slow one never blocks the event loop; one that refuses to (it
    holds an object bound to the thread that made it, such as a sqlite3 connection) runs in the loop's thread,
    from then on."""
    if fn not in _THREAD_BOUND:
        try:
            return await asyncio.to_thread(fn, **kwargs)
        except sqlite3.ProgrammingError as error:
            if "same thread" not in str(error):
                raise
            _THREAD_BOUND.add(fn)
    return fn(**kwargs)


_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:e-?\d+)?$", re.IGNORECASE)


def normalize(value: Any) -> Any:
    """A comparable form of an answer: numbers as floats, text trimmed and lower-cased, lists as sorted tuples."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, list | tuple | set):
        return tuple(sorted((normalize(v) for v in value), key=repr))
    if value is None:
        return None
    text = str(value).strip().strip("`").strip().rstrip(".").strip()
    cleaned = text.replace(",", "").replace("$", "")
    if _NUMBER.match(cleaned):
        return float(cleaned)
    if "\n" in text or (";" in text and not text.startswith("[")):
        parts = [p for p in re.split(r"[\n;]", text) if p.strip()]
        return normalize(parts)
    if text.startswith("[") and text.endswith("]"):
        try:
            return normalize(json.loads(text))
        except json.JSONDecodeError:
            pass
    return text.lower()


def answers_match(expected: Any, given: Any, rel_tol: float = 1e-3) -> bool:
    """Whether `given` is `expected` up to formatting (numbers within `rel_tol`, order of lists ignored)."""
    a, b = normalize(expected), normalize(given)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-6)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(answers_match(x, y, rel_tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, tuple) and len(a) == 1:
        return answers_match(a[0], given, rel_tol)
    return a == b


def exact_match_reward(scenario: Scenario, answer: Any) -> float:
    """1.0 when the answer matches the scenario's, else 0.0."""
    return 1.0 if answer is not None and answers_match(scenario.answer, answer) else 0.0
