"""The MCP environment: a local MCP server's tools (stdio and streamable HTTP) become OpenAI tools + callables."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from art_adapters.envs import MCPServerSpec, ToolSet, mcp_toolset

SERVER = Path(__file__).resolve().parents[1] / "examples" / "mcp_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the MCP test server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


async def exercise(tools: ToolSet) -> None:
    assert [t.name for t in tools] == ["add", "read_note", "list_notes"]
    add = next(s for s in tools.schemas if s["function"]["name"] == "add")
    assert add["type"] == "function" and add["function"]["description"] == "Add two numbers."
    assert add["function"]["parameters"]["required"] == ["a", "b"]
    assert await tools.call("add", '{"a": 2, "b": 3.5}') == "5.5"
    assert await tools.call("read_note", {"key": "capital-of-peru"}) == "Lima"
    assert (await tools.call("list_notes", "{}")).split() == ["capital-of-peru", "launch-code"]
    results = await asyncio.gather(*(tools.call("add", {"a": i, "b": 1}) for i in range(8)))
    assert results == [f"{i + 1:.1f}" for i in range(8)]
    for name, args in [
        ("read_note", '{"key": "missing"}'),
        ("add", '{"a": "x"}'),
        ("add", "[1]"),
        ("nope", "{}"),
    ]:
        out = await tools.call(name, args)
        assert out.startswith("Error:"), (name, out)
    # the callables themselves are plain async functions
    assert await tools.functions["add"](a=1, b=1) == "2.0"


async def test_stdio_server_tools() -> None:
    async with mcp_toolset(MCPServerSpec.stdio(sys.executable, str(SERVER))) as tools:
        await exercise(tools)


async def test_streamable_http_server_tools(http_url: str) -> None:
    async with mcp_toolset(http_url) as tools:
        await exercise(tools)


async def test_prefix_and_calls_after_close(http_url: str) -> None:
    async with mcp_toolset(MCPServerSpec.http(http_url), prefix="notes_") as tools:
        assert [t.name for t in tools] == ["notes_add", "notes_read_note", "notes_list_notes"]
    out = await tools.call("notes_add", {"a": 1, "b": 2})
    assert out.startswith("Error:")


def test_spec_parsing() -> None:
    assert MCPServerSpec.parse("http://h:1/mcp").url == "http://h:1/mcp"
    spec = MCPServerSpec.parse("python -m server --flag 'a b'")
    assert spec.command == "python" and spec.args == ["-m", "server", "--flag", "a b"]


async def test_a_tool_call_that_hangs_is_an_error_after_the_timeout() -> None:
    slow = MCPServerSpec.stdio(sys.executable, str(Path(__file__).parent / "mcp_slow_server.py"))
    async with mcp_toolset(slow, timeout_s=1.0) as tools:
        assert await tools.call("wait", {"seconds": 0}) == "waited 0.0"
        out = await tools.call("wait", {"seconds": 30})
    assert out == "Error: tool wait took longer than 1s and was abandoned"
