"""Reading what clients, buckets and upstreams send without trusting it: names as single path segments, step numbers
in ASCII digits only, JSON nesting depth counted without recursion, object keys as relative paths, and request
headers forwarded by allow-list.

The bottom of the layers (it imports nothing of ours), so every door uses the same checks.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

_DIGITS = frozenset("0123456789")
MAX_STEP_DIGITS = 12  # a step number, not a 4,300-digit int() that raises

# Request headers a forwarder passes to the model's server (everything else stays here): what the OpenAI and
# Anthropic APIs read. Not vLLM's `X-Request-Id` (another client's id can collide with it), `X-data-parallel-rank`
# (picks an engine replica), tracing headers, cookies, nor anything naming a hop.
FORWARDED_REQUEST_HEADERS = frozenset(
    {
        "accept",
        "content-type",
        "user-agent",
        "anthropic-version",
        "anthropic-beta",
        "openai-beta",
    }
)


def parse_step(text: str) -> int | None:
    """The step number `text` spells in ASCII digits (`"0003"` -> 3), or None (`"²"`, `"٣"`, `"+3"`, `""`, a
    number too long to be a step). `str.isdigit()` says yes to superscripts and other scripts' digits, which
    `int()` then refuses or reads as another number."""
    if not text or len(text) > MAX_STEP_DIGITS or not _DIGITS.issuperset(text):
        return None
    return int(text)


def nesting_depth(value: Any, stop_at: int) -> int:
    """Depth of nested lists/objects (a scalar is 0), counted without recursion; stops counting past `stop_at`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_at:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def relative_key_problem(relative: str) -> str | None:
    """Why an object key (relative to a model's folder) may not become a local path, or None when it may: it must
    be `/`-separated names, none empty, `.` or `..`, with no NUL or backslash (an absolute tail, `a//b`,
    `checkpoints/0001/../../x` are all refused)."""
    if not relative:
        return "an empty name"
    if "\x00" in relative or "\\" in relative:
        return "a NUL or backslash in its name"
    for part in relative.split("/"):
        if part in ("", ".", ".."):
            return f"a path segment {part!r}"
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine's loopback."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The request headers a forwarder passes on: those in `FORWARDED_REQUEST_HEADERS`, with printable ASCII
    values only (a header an HTTP client cannot encode would fail the request after it was admitted)."""
    out: dict[str, str] = {}
    for name, value in headers:
        if name.lower() in FORWARDED_REQUEST_HEADERS and _printable_ascii(value):
            out[name.lower()] = value
    return out


def _printable_ascii(value: str) -> bool:
    return all(" " <= c <= "~" or c == "\t" for c in value)


# A model, project or split name: a single path segment, whole (a trailing newline is refused).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value) or value in {".", ".."}:
        raise ValueError(f"{kind} name {value!r} must match {NAME_PATTERN.pattern} (and not be '.' or '..')")
    return value


def names_loopback(host: str | None, origin: str | None, allowed: Iterable[str] = ()) -> bool:
    """Whether a request names this machine's loopback (or an `allowed` host) in `Host` and, if sent, in `Origin`:
    what a keyless server answers, so a web page whose name was rebound to 127.0.0.1 is refused. A header that does
    not parse (`[::1`) names nothing."""
    names = {a.lower() for a in allowed}

    def ok(hostname: str | None) -> bool:
        return bool(hostname) and (hostname in names or is_loopback(hostname or ""))

    try:
        if host is not None and not ok(urlsplit(f"//{host}").hostname):
            return False
        if origin is None:
            return True
        parsed = urlsplit(origin)
        return parsed.scheme in ("http", "https") and ok(parsed.hostname)
    except ValueError:
        return False
