"""Child processes that never outlive us: a supervisor leading its own process group, ports, log tails."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

LIVE_GROUPS: set[int] = set()  # process-group ids of servers still running, killed at interpreter exit
_PR_SET_PDEATHSIG = 1


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@atexit.register
def _kill_all_live_groups(grace_s: float = 3.0) -> None:
    """At exit: ask each supervisor to stop vLLM (SIGTERM), then SIGKILL whatever is left."""
    for pgid in LIVE_GROUPS:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(group_pids(g) for g in LIVE_GROUPS):
        time.sleep(0.1)
    for pgid in list(LIVE_GROUPS):
        kill_group(pgid)
    LIVE_GROUPS.clear()


def set_parent_death_signal() -> None:
    """preexec_fn: the child gets SIGTERM when the thread that spawned it dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# The direct child: a small supervisor that leads the process group and runs vLLM under it. vLLM's
# EngineCore/Worker processes outlive a SIGKILLed API server, so the supervisor (SIGTERMed on parent death via
# PR_SET_PDEATHSIG, and polling getppid() as a backup) asks vLLM to stop, then SIGKILLs the whole group.
SUPERVISOR_SCRIPT = r"""
import ctypes, os, signal, subprocess, sys, time
parent, argv, grace = int(sys.argv[1]), sys.argv[3:], float(sys.argv[2])
stop = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *_: stop.append(1))
if os.getppid() != parent:
    sys.exit(1)
def pdeath():
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL, 0, 0, 0)
child = subprocess.Popen(argv, preexec_fn=pdeath)
while child.poll() is None and not stop and os.getppid() == parent:
    time.sleep(0.2)
if child.poll() is None:
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        pass
me = os.getpid()
for _ in range(50):
    found = False
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit() or int(pid) == me:
                continue
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[2]) == me:
                os.kill(int(pid), signal.SIGKILL)
                found = True
        except (OSError, ValueError, IndexError):
            pass
    if not found:
        break
    time.sleep(0.1)
sys.exit(child.poll() if child.poll() is not None else 1)
"""


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (reads /proc)."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    """``preferred`` when it is free, else a free port picked by the OS."""
    if preferred and port_is_free(preferred, host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listener_owned_by(port: int, pgid: int) -> bool | None:
    """Whether every socket listening on `port` (any address, IPv4 or IPv6) is held by a process of group `pgid`;
    None when nothing listens there yet. Linux (`/proc`); elsewhere always None, as if not yet listening.

    What keeps a local user from taking a child server's port (it is on the child's argv) before the child binds
    it, and so receiving the key we send to check it is ready."""
    listening = _listening_inodes(port)
    if not listening:
        return None
    held: set[int] = set()
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        held.add(int(target[8:-1]))
    return listening <= held


def _listening_inodes(port: int) -> set[int]:
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows, None)
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
    return inodes


def tail_lines(path: str | os.PathLike[str], n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "<no log>"
