"""A real PostgreSQL server for the tests, started as a user would: `initdb` into a temporary folder, `pg_ctl
start` on 127.0.0.1 with a password (scram-sha-256), stopped at the end. As root it runs as the `postgres` user
(the server refuses root). Skipped, saying why, where no PostgreSQL server binaries are installed (.ci/run installs
Debian's `postgresql`)."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """`postgresql://art:PASSWORD@127.0.0.1:PORT/postgres` of a server running for this test session."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    root = Path(tempfile.mkdtemp(prefix="art-postgres-"))  # under /tmp: the server user can reach it
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    password = secrets.token_hex(12)
    (root / "pw").write_text(password)
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and no 'postgres' user to run the server as")
        os.chmod(root, 0o755)
        for path in (root, sockets, root / "pw"):
            os.chown(path, user.pw_uid, user.pw_gid)
    port = _free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120}
    (root / "log").touch()
    if os.geteuid() == 0:
        os.chown(root / "log", user.pw_uid, user.pw_gid)
    subprocess.run(
        _as_server_user(
            [
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                "art",
                "--auth=scram-sha-256",
                f"--pwfile={root / 'pw'}",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        ),
        **run,
    )
    options = f"-h 127.0.0.1 -p {port} -k {sockets} -c fsync=off -c shared_buffers=16MB"
    subprocess.run(
        _as_server_user(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "log"),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ]
        ),
        **run,
    )
    try:
        yield f"postgresql://art:{password}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_server_user(
                [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"]
            ),
            capture_output=True,
            timeout=120,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)
