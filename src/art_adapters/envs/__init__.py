"""Tool environments with scenarios and a verifiable reward: SQLite and MCP (imported on first use)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .base import (
    Environment,
    Scenario,
    Tool,
    ToolError,
    ToolSet,
    answers_match,
    call_tool,
    exact_match_reward,
)

if TYPE_CHECKING:
    from .mcp import MCPServerSpec, mcp_toolset
    from .sqlite import ReadOnlyDatabase, SQLiteEnv, build_database, extract_answer

_LAZY = {
    "MCPServerSpec": ".mcp",
    "mcp_toolset": ".mcp",
    "ReadOnlyDatabase": ".sqlite",
    "SQLiteEnv": ".sqlite",
    "build_database": ".sqlite",
    "extract_answer": ".sqlite",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


__all__ = [
    "Environment",
    "MCPServerSpec",
    "ReadOnlyDatabase",
    "SQLiteEnv",
    "Scenario",
    "Tool",
    "ToolError",
    "ToolSet",
    "answers_match",
    "build_database",
    "call_tool",
    "exact_match_reward",
    "extract_answer",
    "mcp_toolset",
]
