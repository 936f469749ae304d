"""The trajectory store on SQL: one row per trajectory (reward, when it came, when it trained), one per recorded
call. The same statements run on SQLite and PostgreSQL; each write is one short transaction."""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from ..calls import LLMCall
from ..trajectories import Trajectory
from .call_rewards import CallRewards, apply_call_rewards
from .records import (
    MAX_CONTINUATIONS,
    RewardConflict,
    StoreConnectionError,
    check_id,
    continuation_id,
    dump_json,
    finite,
    load_json,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class TrajectoryStore(CallRewards, ABC):
    """Trajectories recorded call by call, rewarded later, claimed for training once rewarded."""

    placeholder = "?"
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT"
    skip_locked = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: Any = self._connect()
        self.unreadable: dict[str, str] = {}  # trajectory id -> why claim() could not rebuild it (skipped)

        def schema(cursor: Any) -> None:
            for statement in self._schema():
                cursor.execute(statement)

        self._transact(schema)

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
            "CREATE TABLE IF NOT EXISTS art_call_rewards (trajectory_id TEXT NOT NULL, call_index INTEGER NOT NULL,"
            " reward DOUBLE PRECISION NOT NULL, metrics TEXT NOT NULL, metadata TEXT NOT NULL,"
            " rewarded_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (trajectory_id, call_index))",
        ]

    def _lost(self, error: BaseException | None) -> bool:
        """Whether the connection is gone (a server restart, a failover): then reconnect and retry. SQLite's file
        is never lost."""
        return False

    def _transact(self, work: Callable[[Any], T]) -> T:
        """Run `work(cursor)` in one transaction and commit. A connection found lost (before, or by the error
        `work` raised) is replaced and the transaction run once more; a second failure raises."""
        with self._lock:
            for attempt in (1, 2):
                if self._lost(None):
                    self._reconnect()
                cursor = self._connection.cursor()
                try:
                    result = work(cursor)
                    self._connection.commit()
                    return result
                except BaseException as error:
                    try:
                        self._connection.rollback()
                    except Exception:  # the connection is gone: nothing to roll back
                        pass
                    lost = isinstance(error, Exception) and self._lost(error)
                    if lost and attempt == 1:
                        log.warning(
                            "trajectory store: connection lost (%s); reconnecting, retrying once", error
                        )
                        self._reconnect()
                        continue
                    if lost:
                        raise StoreConnectionError(
                            f"the trajectory store lost its database connection again on retry: {error}"
                        ) from error
                    raise
                finally:
                    try:
                        cursor.close()
                    except Exception:
                        pass
        raise AssertionError("unreachable")

    def _reconnect(self) -> None:
        try:
            self._connection.close()
        except Exception:
            pass
        try:
            self._connection = self._connect()
        except Exception as error:
            raise StoreConnectionError(
                f"the trajectory store cannot reconnect to its database: {error}"
            ) from error

    def _sql(self, statement: str) -> str:
        return statement if self.placeholder == "?" else statement.replace("?", self.placeholder)

    # ---- writing -----------------------------------------------------------------------------------------------
    def add_call(self, trajectory_id: str, call: LLMCall, metadata: Mapping[str, Any] | None = None) -> str:
        """Append one call to the trajectory (made on its first call; `metadata` then kept, later merged); returns
        the id it was recorded under. A trajectory already rewarded (or trained) is closed: the call starts, or
        joins, its continuation (`open_id`), whose metadata names it (`continues`) and starts as a copy of its
        (the group it trains in)."""
        check_id(trajectory_id)
        body = dump_json(call)
        now = time.time()

        def work(cursor: Any) -> str:
            target = self._open_id(cursor, trajectory_id)
            extra = dict(metadata or {})
            if target != trajectory_id:
                extra["continues"] = trajectory_id
            continues = extra.get("continues")
            if isinstance(continues, str) and continues != target:
                cursor.execute(self._sql("SELECT id FROM art_trajectories WHERE id = ?"), (target,))
                if (
                    cursor.fetchone() is None
                ):  # a new continuation: the metadata it continues, then this call's
                    cursor.execute(
                        self._sql("SELECT metadata FROM art_trajectories WHERE id = ?"), (continues,)
                    )
                    row = cursor.fetchone()
                    extra = {**json.loads(row[0] or "{}"), **extra} if row is not None else extra
            self._touch(cursor, target, now, extra or None)
            cursor.execute(
                self._sql("INSERT INTO art_calls (trajectory_id, started_at, body) VALUES (?, ?, ?)"),
                (target, call.started_at, body),
            )
            return target

        return self._transact(work)

    def open_id(self, trajectory_id: str) -> str:
        """The id the next call of `trajectory_id` is recorded under: itself while it has no reward, else its first
        continuation without one (`ID.2`, `ID.3`, ...)."""
        check_id(trajectory_id)
        return self._transact(lambda cursor: self._open_id(cursor, trajectory_id))

    def _open_id(self, cursor: Any, trajectory_id: str) -> str:
        candidate = trajectory_id
        for n in range(2, MAX_CONTINUATIONS + 2):
            cursor.execute(
                self._sql("SELECT rewarded_at, trained_at FROM art_trajectories WHERE id = ?"), (candidate,)
            )
            row = cursor.fetchone()
            if row is None or (row[0] is None and row[1] is None):
                return candidate
            candidate = continuation_id(trajectory_id, n)
        raise ValueError(
            f"trajectory {trajectory_id!r} was continued {MAX_CONTINUATIONS} times after rewards: name a new one"
        )

    def add(self, trajectory: Trajectory, trajectory_id: str) -> None:
        """Store a whole trajectory (from an OTLP endpoint or an import), waiting for its reward like the rest."""
        check_id(trajectory_id)
        body = dump_json(trajectory)

        def work(cursor: Any) -> None:
            self._touch(cursor, trajectory_id, time.time(), None)
            cursor.execute(
                self._sql("UPDATE art_trajectories SET body = ? WHERE id = ?"), (body, trajectory_id)
            )

        self._transact(work)

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
        reward = finite(reward, "a reward")
        encoded = json.dumps(dict(sorted((metrics or {}).items())))

        def work(cursor: Any) -> tuple[str, Any]:
            now = time.time()
            cursor.execute(
                self._sql(
                    "UPDATE art_trajectories SET reward = ?, metrics = ?, rewarded_at = ?, updated_at = ?"
                    " WHERE id = ? AND rewarded_at IS NULL"
                ),
                (reward, encoded, now, now, trajectory_id),
            )
            if cursor.rowcount == 1:
                if metadata:
                    self._merge_metadata(cursor, trajectory_id, metadata)
                return "set", None
            cursor.execute(
                self._sql("SELECT reward, metrics FROM art_trajectories WHERE id = ?"), (trajectory_id,)
            )
            return "", cursor.fetchone()

        outcome, row = self._transact(work)
        if outcome:
            return outcome
        if row is None:
            raise KeyError(trajectory_id)
        if row[0] == reward and (row[1] or "{}") == encoded:
            return "unchanged"
        raise RewardConflict(f"trajectory {trajectory_id!r} already has reward {row[0]} (metrics {row[1]})")

    # ---- reading -----------------------------------------------------------------------------------------------
    _COLUMNS = "SELECT id, metadata, body, reward, metrics FROM art_trajectories WHERE id = ?"

    def get(self, trajectory_id: str) -> Trajectory | None:
        rows = self._transact(lambda cursor: self._fetch(cursor, trajectory_id))
        return self._build(*rows) if rows is not None else None

    def _fetch(self, cursor: Any, trajectory_id: str) -> tuple[Any, list[str], list[Any]] | None:
        """A trajectory's row, when it has no whole body its calls' bodies in order, and its calls' rewards."""
        cursor.execute(self._sql(self._COLUMNS), (trajectory_id,))
        row = cursor.fetchone()
        if row is None:
            return None
        cursor.execute(
            self._sql(
                "SELECT call_index, reward, metrics, metadata FROM art_call_rewards WHERE trajectory_id = ?"
                " ORDER BY call_index"
            ),
            (trajectory_id,),
        )
        call_rewards = list(cursor.fetchall())
        if row[2]:
            return row, [], call_rewards
        cursor.execute(
            self._sql("SELECT body FROM art_calls WHERE trajectory_id = ? ORDER BY started_at, seq"),
            (trajectory_id,),
        )
        return row, [r[0] for r in cursor.fetchall()], call_rewards

    def _build(self, row: Any, call_bodies: list[str], call_rewards: Sequence[Any] = ()) -> Trajectory:
        trajectory_id, metadata, body, reward, metrics = row
        if body:
            trajectory = load_json(Trajectory, body)
        else:
            calls = [load_json(LLMCall, text) for text in call_bodies]
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
        apply_call_rewards(trajectory, call_rewards)
        return trajectory

    def claim(self, limit: int, lease_s: float = 600.0) -> list[tuple[str, Trajectory]]:
        """Up to `limit` rewarded trajectories not yet trained, oldest reward first, claimed for `lease_s` (a
        trainer that dies before `mark_trained` leaves them claimable again once the lease ends; `renew` keeps
        them). A trajectory that cannot be rebuilt (a row an older version wrote, a body edited by hand) is
        skipped: logged, kept in `unreadable` with the reason, left claimed (tried again once its lease ends)."""

        def work(cursor: Any) -> list[tuple[str, Any]]:
            now = time.time()
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
            return [(trajectory_id, self._fetch(cursor, trajectory_id)) for trajectory_id in ids]

        out = []
        for trajectory_id, rows in self._transact(work):
            try:
                out.append((trajectory_id, self._build(*rows)))
            except Exception as error:  # one bad row never stops the others training
                reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                self.unreadable[trajectory_id] = reason[:500]
                log.warning(
                    "trajectory store: skipped trajectory %r, it cannot be read back (%s)",
                    trajectory_id,
                    reason,
                )
        return out

    def renew(self, trajectory_ids: list[str]) -> None:
        """Extend the lease of claimed trajectories still held (waiting for partners of their group)."""
        now = time.time()

        def work(cursor: Any) -> None:
            for trajectory_id in trajectory_ids:
                cursor.execute(
                    self._sql(
                        "UPDATE art_trajectories SET claimed_at = ? WHERE id = ? AND trained_at IS NULL"
                        " AND claimed_at IS NOT NULL"
                    ),
                    (now, trajectory_id),
                )

        if trajectory_ids:
            self._transact(work)

    def _begin_claim(self, cursor: Any) -> None:
        """Before a claim's SELECT (PostgreSQL locks the rows it selects: nothing to do first)."""
        return None

    def mark_trained(self, trajectory_ids: list[str]) -> None:
        now = time.time()

        def work(cursor: Any) -> None:
            for trajectory_id in trajectory_ids:
                cursor.execute(
                    self._sql("UPDATE art_trajectories SET trained_at = ? WHERE id = ?"), (now, trajectory_id)
                )

        self._transact(work)

    def release(self, trajectory_ids: list[str]) -> None:
        """Give claimed trajectories back (not trained: e.g. their group never filled)."""

        def work(cursor: Any) -> None:
            for trajectory_id in trajectory_ids:
                cursor.execute(
                    self._sql(
                        "UPDATE art_trajectories SET claimed_at = NULL WHERE id = ? AND trained_at IS NULL"
                    ),
                    (trajectory_id,),
                )

        self._transact(work)

    def counts(self) -> dict[str, int]:
        def work(cursor: Any) -> dict[str, int]:
            cursor.execute("SELECT COUNT(*), COUNT(rewarded_at), COUNT(trained_at) FROM art_trajectories")
            total, rewarded, trained = cursor.fetchone()
            cursor.execute("SELECT COUNT(*) FROM art_calls")
            calls = cursor.fetchone()[0]
            return {"trajectories": total, "rewarded": rewarded, "trained": trained, "calls": calls}

        return self._transact(work)

    # ---- retention ---------------------------------------------------------------------------------------------
    def prune(self, *, max_age_s: float | None = None, max_trajectories: int | None = None) -> int:
        """Delete trajectories not updated for `max_age_s`, then the oldest beyond `max_trajectories`; returns how
        many went."""

        def work(cursor: Any) -> int:
            doomed: list[str] = []
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
                cursor.execute(
                    self._sql("DELETE FROM art_call_rewards WHERE trajectory_id = ?"), (trajectory_id,)
                )
                cursor.execute(self._sql("DELETE FROM art_trajectories WHERE id = ?"), (trajectory_id,))
            return len(set(doomed))

        return self._transact(work)

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
