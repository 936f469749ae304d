"""The framing between the backend and a sharded trainer's leader: length-prefixed JSON over a Unix socket (nothing
is pickled). Both sides import it; it needs neither torch nor a process group."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
MAX_MESSAGE_BYTES = 1 << 31  # a step's trajectories as JSON; anything larger is a corrupt stream


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, default=_jsonable).encode()
    conn.sendall(_HEADER.pack(len(data)) + data)


def receive(conn: socket.socket) -> dict[str, Any]:
    size = _HEADER.unpack(_exactly(conn, _HEADER.size))[0]
    if size > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"a trainer message of {size} bytes: the stream is corrupt")
    return json.loads(_exactly(conn, size))


def _exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end closed the trainer's socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
