"""Record mode: every call a production agent makes through the recording endpoint or `serve` is stored as part of a
trajectory, and `POST /rewards/{trajectory_id}` joins the reward that arrives minutes or days later
(`POST /rewards/{trajectory_id}/calls/{n}`: one call's own reward).

The client names the trajectory with an `x-art-trajectory` header, or one is opened per conversation (a call whose
messages continue an earlier call's messages and answer joins that call's trajectory, unless that earlier exchange
is ambiguous: two conversations recorded it, or another call already continued it differently); every answer
carries the trajectory's id in `x-art-trajectory`. A trajectory already rewarded is closed: a later call of it
starts its continuation (`ID.2`, named in that answer's header). `x-art-group` files the trajectory under a group key (the same task, the
same prompt) for training. Calls are redacted (`redact`, default: keys and Authorization headers dropped) before
they are stored; `retention` bounds the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..conversations import message_key
from ..redaction import Redactor, apply, drop_secrets
from ..store import RewardConflict, TrajectoryStore, open_store
from ..store.records import check_id
from ..trajectories import Trajectory
from .scope import CURRENT

log = logging.getLogger(__name__)

TRAJECTORY_HEADER, GROUP_HEADER = "x-art-trajectory", "x-art-group"
MAX_REWARD_BODY = 64 * 1024
MAX_REWARD_FIELDS = 64
# A request with more messages than this starts a trajectory of its own instead of being matched to an open one
# (matching is linear in the messages, and runs on the server's event loop).
MAX_CHAINED_MESSAGES = 4096


@dataclass
class Retention:
    """How long and how much the store keeps (checked every `every_calls` recorded calls)."""

    max_age_s: float | None = 30 * 24 * 3600.0
    max_trajectories: int | None = 1_000_000
    every_calls: int = 1000


class LiveRecorder:
    """The record mode shared by `RecordingEndpoint(..., record=...)` and `art-adapters serve --record URL`."""

    def __init__(
        self,
        store: TrajectoryStore | str,
        *,
        redact: Redactor | None = drop_secrets,
        retention: Retention | None = None,
        reward_key: str | None = None,
        max_conversations: int = 100_000,
    ) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        self.redact = redact
        self.retention = retention or Retention()
        self.reward_key = reward_key
        self.max_conversations = max_conversations
        self.recorded = 0
        self.failed = 0
        # digest of an exchange (its messages + answer) -> the conversations that recorded it
        self._conversations: OrderedDict[str, _Exchange] = OrderedDict()

    def require_key(self) -> str:
        """The key `POST /rewards/...` needs (made now if none was given)."""
        if not self.reward_key:
            self.reward_key = secrets.token_urlsafe(24)
        return self.reward_key

    # ---- recording ---------------------------------------------------------------------------------------------
    async def record(self, request: Any, raw: bytes, forward: Callable[[Trajectory], Awaitable[Any]]) -> Any:
        """Forward the request (its body `raw`, already read and bounded; `forward(scratch)` returns the ASGI
        response, the call captured into `scratch`) and store the call under its trajectory once the answer has
        been sent."""
        from starlette.responses import JSONResponse, Response

        named = request.headers.get(TRAJECTORY_HEADER)
        try:
            body = json.loads(raw or b"{}")
        except RecursionError:
            return JSONResponse({"error": {"message": "request body nested too deeply"}}, status_code=400)
        except ValueError:
            body = {}  # the forward answers it
        messages = body.get("messages") if isinstance(body, dict) else None
        try:
            trajectory_id, known = (check_id(named), True) if named else self._conversation(messages)
            group = request.headers.get(GROUP_HEADER)
            if group is not None and not 0 < len(group) <= 256:
                raise ValueError("x-art-group is 1-256 characters")
            opened = trajectory_id
            if known:  # rewarded already: this call starts (or joins) its continuation
                trajectory_id = await self._open_id(trajectory_id)
        except ValueError as error:
            return JSONResponse({"error": {"message": str(error)}}, status_code=400)
        scratch = Trajectory()
        inner = await forward(scratch)
        metadata: dict[str, Any] = {"group": group} if group else {}
        if trajectory_id != opened:
            metadata["continues"] = opened

        async def app(scope: Any, receive: Any, send: Any) -> None:
            stored = False

            async def tagged(message: dict[str, Any]) -> None:
                nonlocal stored
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers") or [])
                    headers.append((TRAJECTORY_HEADER.encode(), trajectory_id.encode()))
                    message = {**message, "headers": headers}
                elif message["type"] == "http.response.body" and not message.get("more_body") and not stored:
                    stored = True  # before the answer ends: the agent's next call finds this conversation
                    await self._store(trajectory_id, scratch, messages, metadata)
                await send(message)

            token = CURRENT.set(scratch)
            try:
                await inner(scope, receive, tagged)
            finally:
                CURRENT.reset(token)
                if not stored:
                    await self._store(trajectory_id, scratch, messages, metadata)

        class Recorded(Response):  # a Response to FastAPI, the wrapped ASGI app when it runs
            def __init__(self) -> None:
                self.background = None

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                await app(scope, receive, send)

        return Recorded()

    def _conversation(self, messages: Any) -> tuple[str, bool]:
        """The trajectory this conversation continues (and True), or a new id (and False). The longest earlier
        exchange it extends decides: recorded by one conversation and not yet continued by another request, it is
        this conversation's; recorded by two (two users opening alike and answered alike), or continued already
        by a different request (a branch, another user), a new trajectory starts."""
        if isinstance(messages, list) and len(messages) <= MAX_CHAINED_MESSAGES:
            digests = _prefix_digests([message_key(m) for m in messages if isinstance(m, dict)])
            for digest in reversed(digests[:-1]):  # the longest earlier prefix first
                exchange = self._conversations.get(digest)
                if exchange is None:
                    continue
                if len(exchange.trajectories) != 1 or exchange.continued_by not in (None, digests[-1]):
                    break  # ambiguous: not merged into anyone's trajectory
                exchange.continued_by = digests[-1]
                return exchange.trajectories[0], True
        return secrets.token_hex(16), False

    async def _open_id(self, trajectory_id: str) -> str:
        try:
            return await asyncio.to_thread(self.store.open_id, trajectory_id)
        except ValueError:
            raise
        except Exception:  # the store is down: the call is still served (and its storing will log)
            log.exception("record mode: looking up trajectory %s failed", trajectory_id)
            return trajectory_id

    async def _store(
        self, trajectory_id: str, scratch: Trajectory, messages: Any, metadata: dict[str, Any] | None
    ) -> None:
        try:
            kept = apply(self.redact, scratch)
            for call in kept.llm_calls if kept is not None else []:
                stored = await asyncio.to_thread(self.store.add_call, trajectory_id, call, metadata)
                if stored != trajectory_id:
                    log.warning(
                        "record mode: trajectory %s was rewarded while its call ran; the call is recorded in its "
                        "continuation %s",
                        trajectory_id,
                        stored,
                    )
                self.recorded += 1
                answer = call.response_message()
                if isinstance(messages, list) and answer is not None:
                    key = _prefix_digests(
                        [message_key(m) for m in [*messages, answer] if isinstance(m, dict)]
                    )[-1]
                    exchange = self._conversations.setdefault(key, _Exchange())
                    if stored not in exchange.trajectories:
                        exchange.trajectories.append(stored)
                    self._conversations.move_to_end(key)
                    while len(self._conversations) > self.max_conversations:
                        self._conversations.popitem(last=False)
                if self.recorded % self.retention.every_calls == 0:
                    await asyncio.to_thread(
                        self.store.prune,
                        max_age_s=self.retention.max_age_s,
                        max_trajectories=self.retention.max_trajectories,
                    )
        except Exception:  # the agent got its answer; a store that fails is logged, never raised at it
            self.failed += 1
            log.exception("record mode: storing a call of trajectory %s failed", trajectory_id)

    # ---- rewards -----------------------------------------------------------------------------------------------
    async def reward_endpoint(self, request: Any) -> Any:
        """`POST /rewards/{trajectory_id}` with `{"reward": 1.0, "metrics": {...}, "metadata": {...}}`: 200 set or
        unchanged (idempotent), 404 unknown trajectory, 409 a different reward was already set, 400 bad body,
        401 bad key, 413 body too large."""
        return await self._join_reward(request, None)

    async def call_reward_endpoint(self, request: Any) -> Any:
        """`POST /rewards/{trajectory_id}/calls/{n}`: the same body, key, bounds and answers for the trajectory's
        n-th call (0-based, in `llm_calls` order: by start time, not by when each was recorded): that call's own
        reward (a turn's, docs/training.md 'Credit per turn'); 404 also when the trajectory has no call n. It does
        not close the trajectory: its trajectory reward still decides when it trains (409 once it is claimed)."""
        return await self._join_reward(request, request.path_params.get("n"))

    async def _join_reward(self, request: Any, call: str | None) -> Any:
        from starlette.responses import JSONResponse

        def answer(code: int, **body: Any) -> Any:
            return JSONResponse(body, status_code=code)

        if self.reward_key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.reward_key.encode()
            ):
                return answer(401, detail="bad or missing API key")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_REWARD_BODY):
            return answer(413, detail=f"a reward's body is at most {MAX_REWARD_BODY} bytes")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_REWARD_BODY:
                return answer(413, detail=f"a reward's body is at most {MAX_REWARD_BODY} bytes")
        trajectory_id = request.path_params["trajectory_id"]
        try:
            check_id(trajectory_id)
            index = _call_index(call) if call is not None else None
            reward, metrics, metadata = _reward_body(raw)
        except ValueError as error:
            return answer(400, detail=str(error))
        try:
            if index is None:
                outcome = await asyncio.to_thread(
                    self.store.set_reward, trajectory_id, reward, metrics, metadata
                )
            else:
                outcome = await asyncio.to_thread(
                    self.store.set_call_reward, trajectory_id, index, reward, metrics, metadata
                )
        except KeyError:
            return answer(404, detail=f"no recorded trajectory {trajectory_id!r}")
        except IndexError as error:
            return answer(404, detail=str(error))
        except RewardConflict as error:
            return answer(409, detail=str(error))
        if index is None:
            return answer(200, trajectory_id=trajectory_id, status=outcome)
        return answer(200, trajectory_id=trajectory_id, call=index, status=outcome)


def _call_index(text: str) -> int:
    """A call's index in a URL: decimal digits, at most 9 of them."""
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise ValueError(f"a call index is a number 0..999999999, not {_short(text)}")
    return int(text)


@dataclass
class _Exchange:
    """One recorded exchange (messages + answer): the trajectories that recorded it (more than one: ambiguous),
    and the digest of the request that continued it."""

    trajectories: list[str] = field(default_factory=list)
    continued_by: str | None = None


def _prefix_digests(keys: list[Any]) -> list[str]:
    """The digest of every prefix of `keys` (`[i]`: of `keys[: i + 1]`), chained so all of them cost one pass."""
    out: list[str] = []
    digest = ""
    for key in keys:
        digest = hashlib.sha1(f"{digest}\0{key!r}".encode()).hexdigest()
        out.append(digest)
    return out


def _reward_body(raw: bytes) -> tuple[float, dict[str, float], dict[str, Any]]:
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    except ValueError as error:
        raise ValueError(f"the body is not JSON: {error}") from error
    if not isinstance(body, dict) or "reward" not in body:
        raise ValueError('the body is {"reward": NUMBER, "metrics": {...}, "metadata": {...}}')
    reward = body["reward"]
    if not _finite(reward):
        raise ValueError(f"reward must be a finite number, not {_short(reward)}")
    metrics = body.get("metrics") or {}
    metadata = body.get("metadata") or {}
    if not isinstance(metrics, dict) or not isinstance(metadata, dict):
        raise ValueError("metrics and metadata are objects")
    if len(metrics) > MAX_REWARD_FIELDS or len(metadata) > MAX_REWARD_FIELDS:
        raise ValueError(f"at most {MAX_REWARD_FIELDS} metrics and {MAX_REWARD_FIELDS} metadata fields")
    for name, value in metrics.items():
        if not _finite(value):
            raise ValueError(f"metric {_short(name)} must be a finite number, not {_short(value)}")
    for name, value in metadata.items():
        if not isinstance(value, str | int | float | bool) or (isinstance(value, str) and len(value) > 1024):
            raise ValueError(f"metadata {name!r} must be a scalar (strings up to 1024 characters)")
    return float(reward), {k: float(v) for k, v in metrics.items()}, metadata


def _finite(value: Any) -> bool:
    """A JSON number a float holds, finite (an integer of 400 digits is neither: float() overflows)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"
