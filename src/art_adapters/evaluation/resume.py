"""The attempts file of a resumable evaluation: each finished attempt is appended as one JSON line and fsync'd,
so an interrupted run loses none, and a rerun skips the attempts already there.

The first line records what the evaluation was (its targets, attempts, sampling, scenario ids): a file written
by a different evaluation is refused rather than mixed in. A last line cut short by a crash is dropped."""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from .results import Attempt

FORMAT = 1


class ResumeError(ValueError):
    """The resume file belongs to another evaluation, or cannot be read."""


AttemptKey = tuple[str, str, int]  # (target, scenario id, attempt)


def key_of(attempt: Attempt) -> AttemptKey:
    return (attempt.target, attempt.scenario_id, attempt.attempt)


class AttemptLog:
    """Finished attempts on disk (`path`), for an evaluation described by `fingerprint` (JSON-able)."""

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back
        self._lock = threading.Lock()
        self._held: BinaryIO | None = None  # the open file whose lock says an evaluation is using it
        self.done: dict[AttemptKey, Attempt] = {}

    def open(self) -> dict[AttemptKey, Attempt]:
        """Take the file for this evaluation (another one using it now is refused: both would run every attempt
        and append it twice), read what a previous run finished (none for a new file) and get ready to append;
        returns it. `close()` gives the file back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._held = open(self.path, "ab")  # noqa: SIM115 (held until close())
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise ResumeError(
                f"resume file {str(self.path)!r} is in use by another evaluation running now; wait for it to end, "
                "or use another file"
            ) from None
        try:
            if self.path.stat().st_size > 0:
                self.done = self._read()
            else:
                self._append({"format": FORMAT, "evaluation": self.fingerprint})
        except BaseException:
            self.close()
            raise
        return dict(self.done)

    def close(self) -> None:
        """Give the file back (the lock goes with the handle)."""
        if self._held is not None:
            self._held.close()
            self._held = None

    def _read(self) -> dict[AttemptKey, Attempt]:
        lines = self.path.read_bytes().split(b"\n")
        complete, torn = lines[:-1], lines[-1]  # text after the last newline never finished its write
        if torn.strip():
            with open(self.path, "r+b") as handle:  # cut it, so the next append starts a clean line
                handle.truncate(self.path.stat().st_size - len(torn))
        if not complete:  # cut while its header was written: no attempt finished, so it starts over
            self._append({"format": FORMAT, "evaluation": self.fingerprint})
            return {}
        try:
            header = json.loads(complete[0])
        except ValueError:
            raise ResumeError(
                f"resume file {str(self.path)!r} is not an evaluation's attempts file"
            ) from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ResumeError(f"resume file {str(self.path)!r} is not an evaluation's attempts file")
        theirs = header.get("evaluation")
        if theirs != self.fingerprint:
            differ = sorted(
                k
                for k in set(theirs or {}) | set(self.fingerprint)
                if (theirs or {}).get(k) != self.fingerprint.get(k)
            )
            raise ResumeError(
                f"resume file {str(self.path)!r} was written by a different evaluation (it differs in {differ}); "
                "use another file, or delete it to start over"
            )
        done: dict[AttemptKey, Attempt] = {}
        for number, line in enumerate(complete[1:], 2):
            if not line.strip():
                continue
            try:
                attempt = Attempt.from_dict(json.loads(line))
            except (ValueError, TypeError, KeyError) as error:
                raise ResumeError(f"{self.path}:{number}: not an attempt ({error})") from None
            problem = self._problem(attempt)
            if (
                problem is not None
            ):  # an edited line would otherwise crash the statistics or be silently ignored
                raise ResumeError(
                    f"{self.path}:{number}: {problem}; fix or delete the line (it is run again)"
                )
            done[key_of(attempt)] = attempt
        return done

    def _problem(self, attempt: Attempt) -> str | None:
        """What is wrong with an attempt read back, or None."""
        reward, error = attempt.reward, attempt.error
        if not isinstance(attempt.target, str) or not isinstance(attempt.scenario_id, str):
            return f"target and scenario_id must be text, not {attempt.target!r} and {attempt.scenario_id!r}"
        if isinstance(attempt.attempt, bool) or not isinstance(attempt.attempt, int):
            return f"attempt must be an int, not {attempt.attempt!r}"
        labels = {label for label, _ in self.fingerprint.get("targets", [])}
        if (
            attempt.target not in labels
            or attempt.scenario_id not in self.fingerprint.get("scenarios", [])
            or not 0 <= attempt.attempt < self.fingerprint.get("attempts", 0)
        ):
            return f"{key_of(attempt)} is not one of this evaluation's attempts"
        if error is not None and not isinstance(error, str):
            return f"error must be text or null, not {error!r}"
        finite = isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward)
        if (error is None and not finite) or (error is not None and reward is not None):
            return f"reward {reward!r} with error {error!r}: a finished attempt has a finite reward, an errored none"
        if attempt.success is not None and not isinstance(attempt.success, bool):
            return f"success must be true, false or null, not {attempt.success!r}"
        if not isinstance(attempt.messages, list):
            return "messages must be a list"
        return None

    def add(self, attempt: Attempt) -> None:
        """Append one finished attempt, durably (flushed and fsync'd before this returns)."""
        self._append(asdict(attempt))
        self.done[key_of(attempt)] = attempt

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
