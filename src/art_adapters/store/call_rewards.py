"""Per-call rewards in the trajectory store: `POST /rewards/{id}/calls/{n}` joins one call's own reward (a turn's),
kept in `art_call_rewards` and given back to the call whenever its trajectory is read."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..trajectories import Trajectory
from .records import RewardConflict, check_id, finite, load_json


class CallRewards:
    """The store's per-call rewards (a part of `TrajectoryStore`, which gives `_transact` and `_sql`)."""

    _transact: Callable[..., Any]
    _sql: Callable[[str], str]

    def set_call_reward(
        self,
        trajectory_id: str,
        index: int,
        reward: float,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> str:
        """Join the reward of the trajectory's call `index` (0-based, in `llm_calls` order: by start): "set", or "unchanged" when
        the same one (and metrics) was already set, or a stored whole trajectory's call already carries it; a
        different one raises RewardConflict, an unknown trajectory
        KeyError, a call it does not have IndexError, a reward that is not finite ValueError. The trajectory
        stays open (its own reward decides when it trains) until it is claimed for training: a new call reward
        for a claimed or trained trajectory raises RewardConflict (it would miss the step that holds it; one
        released unclaimed takes it again). `get` and `claim` give the call its reward, its metrics as
        `metrics["call{index}/{name}"]`, its metadata as `metadata["call{index}/{name}"]`."""
        check_id(trajectory_id)
        reward = finite(reward, "a reward")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise IndexError(f"a call index is an integer >= 0, not {index!r}")
        encoded = json.dumps(dict(sorted((metrics or {}).items())))
        meta = json.dumps(dict(metadata or {}))

        def work(cursor: Any) -> tuple[str, Any]:
            cursor.execute(
                self._sql("SELECT body, claimed_at, trained_at FROM art_trajectories WHERE id = ?"),
                (trajectory_id,),
            )
            row = cursor.fetchone()
            if row is None:
                raise KeyError(trajectory_id)
            closed = "already trained" if row[2] is not None else "claimed for training" if row[1] else ""
            carried = None  # the reward a stored whole trajectory's call already has (an import's)
            if row[0]:
                stored = load_json(Trajectory, row[0]).llm_calls
                calls = len(stored)
                carried = stored[index].reward if index < calls else None
            else:
                cursor.execute(
                    self._sql("SELECT COUNT(*) FROM art_calls WHERE trajectory_id = ?"), (trajectory_id,)
                )
                calls = int(cursor.fetchone()[0])
            if index >= calls:
                raise IndexError(
                    f"trajectory {trajectory_id!r} has {calls} recorded call(s): no call {index}"
                )
            cursor.execute(
                self._sql(
                    "SELECT reward, metrics FROM art_call_rewards WHERE trajectory_id = ? AND call_index = ?"
                ),
                (trajectory_id, index),
            )
            existing = cursor.fetchone()
            if existing is not None:
                return "", existing
            if carried is not None and carried != reward:  # set once, as if set here: another one conflicts
                return "", (carried, None)
            if closed and carried is not None:  # the same reward it carried: nothing to change
                return "unchanged", None
            if closed:  # the step that holds (or held) it read its call rewards already
                raise RewardConflict(
                    f"trajectory {trajectory_id!r} was {closed}: a reward for its call {index} would not train"
                )
            now = time.time()
            cursor.execute(
                self._sql(
                    "INSERT INTO art_call_rewards (trajectory_id, call_index, reward, metrics, metadata,"
                    " rewarded_at) VALUES (?, ?, ?, ?, ?, ?)"
                ),
                (trajectory_id, index, reward, encoded, meta, now),
            )
            cursor.execute(
                self._sql("UPDATE art_trajectories SET updated_at = ? WHERE id = ?"), (now, trajectory_id)
            )
            return "unchanged" if carried is not None else "set", None

        outcome, row = self._transact(work)
        if outcome:
            return outcome
        if row[0] == reward and (row[1] or "{}") == encoded:
            return "unchanged"
        raise RewardConflict(
            f"call {index} of trajectory {trajectory_id!r} already has reward {row[0]} (metrics {row[1]})"
        )


def apply_call_rewards(trajectory: Trajectory, rows: Sequence[Any]) -> None:
    """Give the trajectory's calls their stored rewards (rows: call index, reward, metrics, metadata)."""
    for index, call_reward, call_metrics, call_metadata in rows:
        if index < len(trajectory.llm_calls):
            trajectory.llm_calls[index].reward = float(call_reward)
            for name, value in json.loads(call_metrics or "{}").items():
                trajectory.metrics[f"call{index}/{name}"] = value
            for name, value in json.loads(call_metadata or "{}").items():
                if isinstance(value, str | int | float | bool):
                    trajectory.metadata[f"call{index}/{name}"] = value
