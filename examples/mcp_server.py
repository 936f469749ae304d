"""A small MCP server (a notes store and a calculator) for the MCP environment: stdio or streamable HTTP.

python examples/mcp_server.py                      # stdio
python examples/mcp_server.py --http --port 8765   # streamable HTTP at http://127.0.0.1:8765/mcp
"""

from __future__ import annotations

import argparse

try:  # mcp 2.x renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer  # type: ignore[no-redef]

server = MCPServer("notes")
NOTES: dict[str, str] = {"capital-of-peru": "Lima", "launch-code": "not telling"}


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def read_note(key: str) -> str:
    """Read a note by its key."""
    if key not in NOTES:
        raise ValueError(f"no note {key!r}; keys: {', '.join(sorted(NOTES))}")
    return NOTES[key]


@server.tool()
def list_notes() -> list[str]:
    """The keys of all notes."""
    return sorted(NOTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
