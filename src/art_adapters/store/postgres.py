"""The trajectory store on PostgreSQL (psycopg 3), for several servers recording into one place."""

from __future__ import annotations

from typing import Any

from .sql import TrajectoryStore


class PostgresStore(TrajectoryStore):
    """`PostgresStore("postgresql://user:password@host:5432/db")`; claims skip rows another trainer holds. A
    connection lost (a server restart, a failover, a pooler closing it) is replaced on the next transaction, and
    a transaction it broke is run once more on the new one; a server still away raises StoreConnectionError."""

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

    def _lost(self, error: BaseException | None) -> bool:
        import psycopg

        if error is not None and not isinstance(error, psycopg.OperationalError | psycopg.InterfaceError):
            return False
        return bool(self._connection.closed or self._connection.broken)
