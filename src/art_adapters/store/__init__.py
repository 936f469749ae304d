"""Where live traffic waits for its reward: a trajectory store, SQLite by default (a file, no extra dependency) or
PostgreSQL by URL when several servers record (`pip install 'art-adapters[postgres]'`).

    store = open_store("sqlite:///traffic.db")          # or "postgresql://user:pass@host/db"
    store.add_call(trajectory_id, call)                 # the record mode does this for every call
    store.set_reward(trajectory_id, 1.0)                # POST /rewards/{id}, minutes or days later
    for trajectory_id, trajectory in store.claim(32):   # rewarded and not yet trained
        ...
    store.mark_trained(ids)
"""

from __future__ import annotations

from pathlib import Path

from .records import RewardConflict
from .sql import TrajectoryStore
from .sqlite import SQLiteStore

__all__ = ["RewardConflict", "SQLiteStore", "TrajectoryStore", "open_store"]


def open_store(url: str | Path) -> TrajectoryStore:
    """`sqlite:///relative.db`, `sqlite:////absolute.db` (or a plain path) or `postgresql://user:password@host:port/database`."""
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(text)
    if text.startswith("sqlite:///"):  # SQLAlchemy's form: sqlite:///relative.db, sqlite:////absolute.db
        text = text[len("sqlite:///") :]
    if "://" in text:
        raise ValueError(
            f"a store URL is sqlite:///PATH or postgresql://..., not {_without_password(str(url))!r}"
        )
    return SQLiteStore(text)


def _without_password(url: str) -> str:
    """The URL with its password (if any) shown as ***: an error message goes to logs, the password must not."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    user, at, host = authority.rpartition("@")
    if not at or ":" not in user:
        return url
    return f"{scheme}{sep}{user.partition(':')[0]}:***@{host}{slash}{path}"
