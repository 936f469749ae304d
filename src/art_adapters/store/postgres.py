"""The trajectory store on PostgreSQL (psycopg 3), for several servers recording into one place."""

from __future__ import annotations

from typing import Any

from .sql import TrajectoryStore


class PostgresStore(TrajectoryStore):
    """`PostgresStore("postgresql://user:password@host:5432/db")`; claims skip rows another trainer holds."""

    placeholder = "%s"
    serial = "BIGSERIAL PRIMARY KEY"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        super().__init__()

    def _connect(self) -> Any:
        try:
            import psycopg
        except ImportError as error:
            raise ImportError(
                "a PostgreSQL store needs psycopg 3: pip install 'art-adapters[postgres]'"
            ) from error
        return psycopg.connect(self.url, connect_timeout=max(1, round(self.connect_timeout_s)))
