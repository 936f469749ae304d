"""What a stored row is: trajectory ids (ASCII, bounded, continued after a reward as `ID.2`), JSON that reads back
exactly (non-finite numbers, lone surrogates), finite numbers, and the store's errors."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

MAX_ID_LENGTH = 128
# ASCII only: str.isalnum() also takes Cyrillic, fullwidth and superscript look-alikes, each a distinct id
ID_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


# A trajectory rewarded (or trained) is closed: a later call of it is recorded in its continuation, `ID.2`, then
# `ID.3`... (`continuation_id`); at most this many continuations are looked through.
MAX_CONTINUATIONS = 1000


class RewardConflict(ValueError):
    """A trajectory already has a different reward (a reward is set once; the same one again is a no-op)."""


class StoreConnectionError(ConnectionError):
    """The store's database could not be reached (after one reconnect and retry)."""


def dump_json(model: BaseModel) -> str:
    """`model` as JSON text that reads back exactly: non-finite numbers as Infinity/NaN (the models' config), and
    text pydantic cannot encode as UTF-8 (a lone UTF-16 surrogate: an emoji a JavaScript client cut in half)
    escaped as `\\udXXX`, as json.dumps writes it."""
    try:
        return model.model_dump_json()
    except ValueError:  # PydanticSerializationError (a UnicodeEncodeError under it) is a ValueError
        return json.dumps(model.model_dump(mode="json"), allow_nan=True)


def load_json(cls: type[M], text: str) -> M:
    """The inverse of `dump_json` (pydantic's JSON parser refuses an escaped lone surrogate; json.loads keeps it)."""
    try:
        return cls.model_validate_json(text)
    except ValueError:
        return cls.model_validate(json.loads(text))


def finite(value: Any, what: str) -> float:
    """`value` as a finite float, else ValueError naming `what` (an integer too large for a float included)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what} is a finite number, not {str(value)[:40]!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is a finite number, not {number}")
    return number


def continuation_id(trajectory_id: str, n: int) -> str:
    """The id of the `n`-th trajectory continuing `trajectory_id` (n >= 2) after it was rewarded: `ID.n`, or a
    digest of both where that would be longer than an id may be."""
    candidate = f"{trajectory_id}.{n}"
    if len(candidate) <= MAX_ID_LENGTH:
        return candidate
    digest = hashlib.sha256(f"{trajectory_id}\0{n}".encode()).hexdigest()[:40]
    return f"{digest}.{n}"


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
