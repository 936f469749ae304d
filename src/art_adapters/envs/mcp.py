"""MCP environment: any MCP server's tools (stdio or streamable HTTP, via the `mcp` SDK) as an agent ToolSet."""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from .base import Tool, ToolSet


@dataclass
class MCPServerSpec:
    """How to reach an MCP server: a command to spawn (stdio) or a streamable-HTTP URL."""

    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] | None = None

    @classmethod
    def stdio(cls, command: str, *args: str, env: dict[str, str] | None = None, cwd: str | None = None):
        return cls(command=command, args=list(args), env=env, cwd=cwd)

    @classmethod
    def http(cls, url: str, headers: dict[str, str] | None = None) -> MCPServerSpec:
        return cls(url=url, headers=headers)

    @classmethod
    def parse(cls, value: str | MCPServerSpec) -> MCPServerSpec:
        """`http(s)://...` is streamable HTTP; anything else is a command line to spawn."""
        if isinstance(value, MCPServerSpec):
            return value
        if value.startswith(("http://", "https://")):
            return cls.http(value)
        command, *args = shlex.split(value)
        return cls.stdio(command, *args)


@asynccontextmanager
async def mcp_toolset(
    server: str | MCPServerSpec, *, prefix: str = "", timeout_s: float = 30.0
) -> AsyncIterator[ToolSet]:
    """Connect to the server, list its tools, and yield them as a ToolSet of async callables.

    The connection lives as long as the `async with` block; a call after it, one the server rejects, or one that
    takes longer than `timeout_s` is an error string, like any other tool failure.
    """
    from mcp import ClientSession

    spec = MCPServerSpec.parse(server)
    async with AsyncExitStack() as stack:
        if spec.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            http_client = None
            if spec.headers:
                from mcp.shared._httpx_utils import create_mcp_http_client

                http_client = await stack.enter_async_context(create_mcp_http_client(headers=spec.headers))
            streams = await stack.enter_async_context(
                streamable_http_client(spec.url, http_client=http_client)
            )
        else:
            from mcp import StdioServerParameters, stdio_client

            assert spec.command is not None, "an MCP server needs a command or a url"
            params = StdioServerParameters(command=spec.command, args=spec.args, env=spec.env, cwd=spec.cwd)
            streams = await stack.enter_async_context(stdio_client(params))
        read, write = streams[0], streams[1]
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield ToolSet([_tool(session, t, prefix, timeout_s) for t in await _list_tools(session)])


async def _list_tools(session: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    while True:
        if cursor is None:
            listed = await session.list_tools()
        else:
            from mcp.types import PaginatedRequestParams

            listed = await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
        tools.extend(listed.tools)
        cursor = getattr(listed, "next_cursor", None) or getattr(listed, "nextCursor", None)
        if not cursor:
            return tools


def _tool(session: Any, spec: Any, prefix: str, timeout_s: float) -> Tool:
    name = spec.name
    schema = dict(getattr(spec, "input_schema", None) or getattr(spec, "inputSchema", None) or {})
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})

    async def call(**arguments: Any) -> str:
        try:
            result = await asyncio.wait_for(session.call_tool(name, arguments), timeout_s)
        except TimeoutError:
            return f"Error: tool {name} took longer than {timeout_s:g}s and was abandoned"
        text = content_text(result.content)
        if not text and getattr(result, "structured_content", None) is not None:
            text = json.dumps(result.structured_content, default=str)
        is_error = getattr(result, "is_error", None) or getattr(result, "isError", False)
        return f"Error: {text}" if is_error else text

    call.__name__ = prefix + name
    return Tool(prefix + name, spec.description or name, schema, call)


def content_text(content: list[Any]) -> str:
    """MCP content blocks as text: text blocks verbatim, others as JSON."""
    parts: list[str] = []
    for block in content or []:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        elif hasattr(block, "model_dump"):
            parts.append(json.dumps(block.model_dump(mode="json", exclude_none=True)))
        elif isinstance(block, Mapping):
            parts.append(json.dumps(dict(block), default=str))
        else:
            parts.append(str(block))
    return "\n".join(parts)
