"""The trajectory store in a SQLite file (the default: no extra dependency)."""

from __future__ import annotations

import sqlite3
from typing import Any

from .sql import TrajectoryStore


class SQLiteStore(TrajectoryStore):
    """A SQLite file (WAL: several processes on one host may record into it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__()

    def _connect(self) -> Any:
        connection = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA busy_timeout=30000")
        connection.isolation_level = "DEFERRED"
        return connection

    def _begin_claim(self, cursor: Any) -> None:
        self._connection.commit()
        cursor.execute("BEGIN IMMEDIATE")
