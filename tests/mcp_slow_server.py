"""A stdio MCP server with one slow tool, for the MCP timeout test."""

from __future__ import annotations

import time

try:  # mcp 2.x renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]

server = MCPServer("slow")


@server.tool()
def wait(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"waited {seconds}"


if __name__ == "__main__":
    server.run()
