"""The trajectory store on SQL: one row per trajectory (reward, when it came, when it trained), one per recorded
call. The same statements run on SQLite and PostgreSQL; each write is one short transaction."""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..calls import LLMCall
from ..trajectories import Trajectory

MAX_ID_LENGTH = 128
# ASCII only: str.isalnum() also takes Cyrillic, fullwidth and superscript look-alikes, each a distinct id
ID_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


class RewardConflict(ValueError):
    """A trajectory already has a different reward (a reward is set once; the same one again is a no-op)."""


def check_id(trajectory_id: str) -> str:
    if (
        not isinstance(trajectory_id, str)
        or not 0 < len(trajectory_id) <= MAX_ID_LENGTH
        or not all(c in ID_CHARACTERS for c in trajectory_id)
    ):
        raise ValueError(
            f"a trajectory id is 1-{MAX_ID_LENGTH} ASCII characters of A-Z a-z 0-9 - _ . "
            "(no other script's letters or digits)"
        )
    return trajectory_id


class TrajectoryStore(ABC):
    """Trajectories recorded call by call, rewarded later, claimed for training once rewarded."""

    placeholder = "?"
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT"
    skip_locked = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: Any = self._connect()
        with self._tx() as cursor:
            for statement in self._schema():
                cursor.execute(statement)

    # ---- dialect ----------------------------------------------------------------------------------------------
    @abstractmethod
    def _connect(self) -> Any:
        """A DB-API connection (each dialect's own)."""

    def _schema(self) -> list[str]:
        return [
            "CREATE TABLE IF NOT EXISTS art_trajectories (id TEXT PRIMARY KEY, created_at DOUBLE PRECISION NOT NULL,"
            " updated_at DOUBLE PRECISION NOT NULL, metadata TEXT NOT NULL DEFAULT '{}', body TEXT,"
            " reward DOUBLE PRECISION, metrics TEXT, rewarded_at DOUBLE PRECISION, claimed_at DOUBLE PRECISION,"
            " trained_at DOUBLE PRECISION)",
            f"CREATE TABLE IF NOT EXISTS art_calls (seq {self.serial}, trajectory_id TEXT NOT NULL,"
            " started_at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS art_calls_trajectory ON art_calls (trajectory_id)",
            "CREATE INDEX IF NOT EXISTS art_trajectories_ready ON art_trajectories (rewarded_at, trained_at)",
        ]

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._lock:
            cursor = self._connection.cursor()
            try:
                yield cursor
                self._connection.commit()
            except BaseException:
                self._connection.rollback()
                raise
            finally:
                cursor.close()

    def _sql(self, statement: str) -> str:
        return statement if self.placeholder == "?" else statement.replace("?", self.placeholder)

    # ---- writing -----------------------------------------------------------------------------------------------
    def add_call(self, trajectory_id: str, call: LLMCall, metadata: Mapping[str, Any] | None = None) -> None:
        """Append one call to the trajectory (made on its first call; `metadata` then kept, later merged)."""
        check_id(trajectory_id)
        now = time.time()
        with self._tx() as cursor:
            self._touch(cursor, trajectory_id, now, metadata)
            cursor.execute(
                self._sql("INSERT INTO art_calls (trajectory_id, started_at, body) VALUES (?, ?, ?)"),
                (trajectory_id, call.started_at, call.model_dump_json()),
            )

    def add(self, trajectory: Trajectory, trajectory_id: str) -> None:
        """Store a whole trajectory (from an OTLP endpoint or an import), waiting for its reward like the rest."""
        check_id(trajectory_id)
        with self._tx() as cursor:
            self._touch(cursor, trajectory_id, time.time(), None)
            cursor.execute(
                self._sql("UPDATE art_trajectories SET body = ? WHERE id = ?"),
                (trajectory.model_dump_json(), trajectory_id),
            )

    def _touch(self, cursor: Any, trajectory_id: str, now: float, metadata: Mapping[str, Any] | None) -> None:
        cursor.execute(
            self._sql(
                "INSERT INTO art_trajectories (id, created_at, updated_at, metadata) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at"
            ),
            (trajectory_id, now, now, json.dumps(dict(metadata or {}))),
        )
        if metadata:
            self._merge_metadata(cursor, trajectory_id, metadata)

    def _merge_metadata(self, cursor: Any, trajectory_id: str, metadata: Mapping[str, Any]) -> None:
        cursor.execute(self._sql("SELECT metadata FROM art_trajectories WHERE id = ?"), (trajectory_id,))
        row = cursor.fetchone()
        merged = {**json.loads(row[0] or "{}"), **dict(metadata)}
        cursor.execute(
            self._sql("UPDATE art_trajectories SET metadata = ? WHERE id = ?"),
            (json.dumps(merged), trajectory_id),
        )

    def set_reward(
        self,
        trajectory_id: str,
        reward: float,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> str:
        """Join a reward: "set", or "unchanged" when the same one was already set (idempotent). A different one
        raises RewardConflict; an unknown id KeyError; a reward that is not finite ValueError."""
        check_id(trajectory_id)
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"a reward is a finite number, not {reward}")
        encoded = json.dumps(dict(sorted((metrics or {}).items())))
        with self._tx() as cursor:
            cursor.execute(
                self._sql(
                    "UPDATE art_trajectories SET reward = ?, metrics = ?, rewarded_at = ?, updated_at = ?"
                    " WHERE id = ? AND rewarded_at IS NULL"
                ),
                (reward, encoded, time.time(), time.time(), trajectory_id),
            )
            if cursor.rowcount == 1:
                if metadata:
                    self._merge_metadata(cursor, trajectory_id, metadata)
                return "set"
            cursor.execute(
                self._sql("SELECT reward, metrics FROM art_trajectories WHERE id = ?"), (trajectory_id,)
            )
            row = cursor.fetchone()
        if row is None:
            raise KeyError(trajectory_id)
        if row[0] == reward and (row[1] or "{}") == encoded:
            return "unchanged"
        raise RewardConflict(f"trajectory {trajectory_id!r} already has reward {row[0]} (metrics {row[1]})")

    # ---- reading -----------------------------------------------------------------------------------------------
    def get(self, trajectory_id: str) -> Trajectory | None:
        with self._tx() as cursor:
            cursor.execute(
                self._sql("SELECT id, metadata, body, reward, metrics FROM art_trajectories WHERE id = ?"),
                (trajectory_id,),
            )
            row = cursor.fetchone()
            return self._build(cursor, row) if row is not None else None

    def _build(self, cursor: Any, row: Any) -> Trajectory:
        trajectory_id, metadata, body, reward, metrics = row
        if body:
            trajectory = Trajectory.model_validate_json(body)
        else:
            cursor.execute(
                self._sql("SELECT body FROM art_calls WHERE trajectory_id = ? ORDER BY started_at, seq"),
                (trajectory_id,),
            )
            calls = [LLMCall.model_validate_json(r[0]) for r in cursor.fetchall()]
            start = min((c.started_at for c in calls), default=time.time())
            trajectory = Trajectory(llm_calls=calls, start_time=start)
            trajectory.finish()
            trajectory.end_time = max((c.ended_at for c in calls), default=start)
            trajectory.metrics["duration"] = trajectory.end_time - start
        meta = json.loads(metadata or "{}")
        trajectory.metadata.update({k: v for k, v in meta.items() if isinstance(v, str | int | float | bool)})
        trajectory.metadata["trajectory_id"] = trajectory_id
        if reward is not None:
            trajectory.reward = float(reward)
            trajectory.metrics.update(json.loads(metrics or "{}"))
        return trajectory

    def claim(self, limit: int, lease_s: float = 600.0) -> list[tuple[str, Trajectory]]:
        """Up to `limit` rewarded trajectories not yet trained, oldest reward first, claimed for `lease_s` (a
        trainer that dies before `mark_trained` leaves them claimable again once the lease ends)."""
        now = time.time()
        with self._tx() as cursor:
            self._begin_claim(cursor)
            cursor.execute(
                self._sql(
                    "SELECT id FROM art_trajectories WHERE rewarded_at IS NOT NULL AND trained_at IS NULL"
                    " AND (claimed_at IS NULL OR claimed_at < ?) ORDER BY rewarded_at, id LIMIT ?"
                    + self.skip_locked
                ),
                (now - lease_s, int(limit)),
            )
            ids = [r[0] for r in cursor.fetchall()]
            for trajectory_id in ids:
                cursor.execute(
                    self._sql("UPDATE art_trajectories SET claimed_at = ? WHERE id = ?"), (now, trajectory_id)
                )
            out = []
            for trajectory_id in ids:
                cursor.execute(
                    self._sql(
                        "SELECT id, metadata, body, reward, metrics FROM art_trajectories WHERE id = ?"
                    ),
                    (trajectory_id,),
                )
                out.append((trajectory_id, self._build(cursor, cursor.fetchone())))
        return out

    def _begin_claim(self, cursor: Any) -> None:
        """Before a claim's SELECT (PostgreSQL locks the rows it selects: nothing to do first)."""
        return None

    def mark_trained(self, trajectory_ids: list[str]) -> None:
        now = time.time()
        with self._tx() as cursor:
            for trajectory_id in trajectory_ids:
                cursor.execute(
                    self._sql("UPDATE art_trajectories SET trained_at = ? WHERE id = ?"), (now, trajectory_id)
                )

    def release(self, trajectory_ids: list[str]) -> None:
        """Give claimed trajectories back (not trained: e.g. their group never filled)."""
        with self._tx() as cursor:
            for trajectory_id in trajectory_ids:
                cursor.execute(
                    self._sql(
                        "UPDATE art_trajectories SET claimed_at = NULL WHERE id = ? AND trained_at IS NULL"
                    ),
                    (trajectory_id,),
                )

    def counts(self) -> dict[str, int]:
        with self._tx() as cursor:
            cursor.execute("SELECT COUNT(*), COUNT(rewarded_at), COUNT(trained_at) FROM art_trajectories")
            total, rewarded, trained = cursor.fetchone()
            cursor.execute("SELECT COUNT(*) FROM art_calls")
            calls = cursor.fetchone()[0]
        return {"trajectories": total, "rewarded": rewarded, "trained": trained, "calls": calls}

    # ---- retention ---------------------------------------------------------------------------------------------
    def prune(self, *, max_age_s: float | None = None, max_trajectories: int | None = None) -> int:
        """Delete trajectories not updated for `max_age_s`, then the oldest beyond `max_trajectories`; returns how
        many went."""
        doomed: list[str] = []
        with self._tx() as cursor:
            if max_age_s is not None:
                cursor.execute(
                    self._sql("SELECT id FROM art_trajectories WHERE updated_at < ?"),
                    (time.time() - max_age_s,),
                )
                doomed += [r[0] for r in cursor.fetchall()]
            if max_trajectories is not None:
                cursor.execute(
                    self._sql(
                        "SELECT id FROM art_trajectories ORDER BY updated_at DESC, id LIMIT -1 OFFSET ?"
                    )
                    if self.placeholder == "?"
                    else self._sql("SELECT id FROM art_trajectories ORDER BY updated_at DESC, id OFFSET ?"),
                    (int(max_trajectories),),
                )
                doomed += [r[0] for r in cursor.fetchall()]
            for trajectory_id in set(doomed):
                cursor.execute(self._sql("DELETE FROM art_calls WHERE trajectory_id = ?"), (trajectory_id,))
                cursor.execute(self._sql("DELETE FROM art_trajectories WHERE id = ?"), (trajectory_id,))
        return len(set(doomed))

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
