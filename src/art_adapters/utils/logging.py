"""`art_adapters.utils.logging` (ART's path): the timestamped, coloured one-line prints ART's example scripts use."""

from __future__ import annotations

import time


class _C:
    """ANSI colours."""

    RESET = "\x1b[0m"
    DIM = "\x1b[2m"
    BOLD = "\x1b[1m"
    ITAL = "\x1b[3m"
    GRAY = "\x1b[90m"
    BLUE = "\x1b[34m"
    CYAN = "\x1b[36m"
    GREEN = "\x1b[32m"
    YELLOW = "\x1b[33m"
    RED = "\x1b[31m"
    MAGENTA = "\x1b[35m"


def _ts() -> str:
    return time.strftime("%H:%M:%S")


def _line(label: str, colour: str, message: object) -> None:
    print(f"[{_ts()}] {colour}{label:<5}{_C.RESET} {message}")


def info(msg: object) -> None:
    _line("INFO", _C.BLUE, msg)


def step(msg: object) -> None:
    _line("STEP", _C.CYAN, msg)


def ok(msg: object) -> None:
    _line("OK", _C.GREEN, msg)


def warn(msg: object) -> None:
    _line("WARN", _C.YELLOW, msg)


def err(msg: object) -> None:
    _line("ERR", _C.RED, msg)


def dim(msg: object) -> None:
    print(f"{_C.DIM}{msg}{_C.RESET}")


__all__ = ["_C", "_ts", "dim", "err", "info", "ok", "step", "warn"]
