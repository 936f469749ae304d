"""Training records inside traces: what a generation (a call) and a root (a trajectory) must carry so an imported
trace becomes the Trajectory it was, token ids, logprobs, versions and sources exact, in compact packed form.

Token ids are packed little-endian (uint16 where the ids allow, else uint32), logprobs as float32 where that is
exact for every value (vLLM's are float32), else float64, each base64-encoded: about 2.7-5.3 characters per id and
5.3-10.7 per logprob. The request's messages are not repeated: they are the generation's input (a hash checks it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import sys
from array import array
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..calls import LLMCall, SampledChoice
from ..trajectories import History, Trajectory

RECORD_VERSION = 1
CALL_KEY = "art_training"  # a generation's metadata key holding its call's record
TRAJECTORY_KEY = "art_trajectory"  # the root's metadata key holding the trajectory's record
SKIPPED_CALLS_KEY = "art_calls"  # the root's: records of calls whose generations were not sent (deduped)
_ID_FIELDS = ("prompt_token_ids", "token_ids")


class RecordError(ValueError):
    """A training record that cannot be read back (another format version, or damaged in transit)."""


# ---- packed arrays ---------------------------------------------------------------------------------------------


def pack_ids(ids: list[int]) -> str:
    kind = "H" if not ids or max(ids) < 65536 else "I"
    data = array(kind, ids)
    if _big_endian():
        data.byteswap()
    return kind + base64.b64encode(data.tobytes()).decode()


def unpack_ids(text: str) -> list[int]:
    return _unpack(text, ("H", "I"), "token ids")


def pack_floats(values: list[float]) -> str:
    single = array("f", values)
    exact = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(single, values, strict=True))
    data = single if exact else array("d", values)
    if _big_endian():
        data.byteswap()
    return data.typecode + base64.b64encode(data.tobytes()).decode()


def unpack_floats(text: str) -> list[float]:
    return _unpack(text, ("f", "d"), "logprobs")


def _unpack(text: str, kinds: tuple[str, str], what: str) -> list[Any]:
    """The inverse of the packers: a typecode from `kinds`, then the array's little-endian bytes in base64."""
    kind, payload = text[:1], text[1:]
    if kind not in kinds:
        raise RecordError(f"{what} packed as {kind!r}, not {kinds[0]} or {kinds[1]}")
    data = array(kind)
    data.frombytes(base64.b64decode(payload))
    if _big_endian():
        data.byteswap()
    return data.tolist()


def _big_endian() -> bool:
    return sys.byteorder == "big"


def messages_hash(messages: Any) -> str:
    return hashlib.sha1(_compact(messages).encode()).hexdigest()[:16]


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


# ---- one call --------------------------------------------------------------------------------------------------


def pack_call(call: LLMCall, index: int) -> str:
    """The call's training record (a compact JSON string): everything but the request's chat messages, which the
    generation's input carries. `index` numbers the call in its trajectory's record."""
    request = dict(call.request)
    record: dict[str, Any] = {"v": RECORD_VERSION, "k": index}
    if call.api == "chat" and isinstance(request.get("messages"), list):
        record["mh"] = messages_hash(request.pop("messages"))
    record["rq"] = request
    if call.response is not None:
        record["rs"] = _stripped(call.response)
    if call.prompt_token_ids is not None:
        record["p"] = pack_ids(call.prompt_token_ids)
    if call.completion_token_ids is not None:
        record["c"] = pack_ids(call.completion_token_ids)
    if call.logprobs is not None:
        record["l"] = pack_floats(call.logprobs)
    if call.other_choices:
        record["o"] = [_pack_choice(c) for c in call.other_choices]
    fields = call.model_dump(
        include={
            "url",
            "status_code",
            "stream",
            "logprobs_mode",
            "started_at",
            "latency_s",
            "error",
            "policy_version",
            "served_model",
            "reward",
        },
        exclude_none=True,
    )
    record["f"] = fields
    source = call.source.model_dump(exclude_defaults=True)
    if source:
        record["src"] = source
    return _compact_record(record)


def _compact_record(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def _pack_choice(choice: SampledChoice) -> dict[str, Any]:
    out: dict[str, Any] = {"i": choice.index}
    if choice.token_ids is not None:
        out["c"] = pack_ids(choice.token_ids)
    if choice.logprobs is not None:
        out["l"] = pack_floats(choice.logprobs)
    if choice.finish_reason is not None:
        out["fr"] = choice.finish_reason
    return out


def _stripped(response: dict[str, Any]) -> dict[str, Any]:
    """The response without what the packed arrays hold (ids) or what training never reads (per-token logprob
    objects: token strings, bytes, alternatives)."""
    out = {k: v for k, v in response.items() if k not in _ID_FIELDS}
    if isinstance(out.get("choices"), list):
        out["choices"] = [
            {k: v for k, v in c.items() if k not in (*_ID_FIELDS, "logprobs")} if isinstance(c, dict) else c
            for c in out["choices"]
        ]
    return out


def unpack_call(text: str | dict[str, Any], messages: Any) -> tuple[int, LLMCall, bool]:
    """(index, the call, whether its messages matched the record's hash) from a generation's record and input."""
    record = load_record(text)
    request = dict(record.get("rq") or {})
    matched = True
    if "mh" in record:
        matched = isinstance(messages, list) and messages_hash(messages) == record["mh"]
        request["messages"] = messages if isinstance(messages, list) else []
    prompt = unpack_ids(record["p"]) if "p" in record else None
    completion = unpack_ids(record["c"]) if "c" in record else None
    others = [
        SampledChoice(
            index=o["i"],
            token_ids=unpack_ids(o["c"]) if "c" in o else None,
            logprobs=unpack_floats(o["l"]) if "l" in o else None,
            finish_reason=o.get("fr"),
        )
        for o in record.get("o") or []
    ]
    response = record.get("rs")
    if isinstance(response, dict):
        response = _restored(response, prompt, completion, others)
    call = LLMCall(
        request=request,
        response=response,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=unpack_floats(record["l"]) if "l" in record else None,
        other_choices=others,
        source=record.get("src") or {},
        **(record.get("f") or {}),
    )
    return int(record.get("k", 0)), call, matched


def _restored(
    response: dict[str, Any],
    prompt: list[int] | None,
    completion: list[int] | None,
    others: list[SampledChoice],
) -> dict[str, Any]:
    """The ids put back where vLLM's body had them (so a Choice rebuilt from the call carries them)."""
    out = dict(response)
    if prompt is not None and isinstance(out.get("choices"), list):
        out["prompt_token_ids"] = prompt
    by_index = {o.index: o.token_ids for o in others}
    choices = []
    for choice in out.get("choices") or []:
        if isinstance(choice, dict):
            index = choice.get("index", 0)
            ids = completion if index == 0 else by_index.get(index)
            if ids is not None:
                choice = {**choice, "token_ids": ids}
        choices.append(choice)
    if "choices" in out:
        out["choices"] = choices
    return out


def load_record(value: str | dict[str, Any]) -> dict[str, Any]:
    """A record from metadata as Langfuse returns it: a dict, a JSON string, or a JSON string of a JSON string."""
    for _ in range(3):
        if isinstance(value, dict):
            break
        if not isinstance(value, str):
            raise RecordError(f"a training record is a JSON object, not {type(value).__name__}")
        try:
            value = json.loads(value)
        except ValueError as error:
            raise RecordError(f"a training record is not JSON (truncated?): {error}") from error
    if not isinstance(value, dict):
        raise RecordError("a training record is a JSON object")
    if value.get("v") != RECORD_VERSION:
        raise RecordError(f"training record version {value.get('v')!r}; this version reads {RECORD_VERSION}")
    return value


# ---- one trajectory --------------------------------------------------------------------------------------------


def trajectory_calls(trajectory: Trajectory) -> list[LLMCall]:
    """Every distinct call of the trajectory in record order: its own calls, then those only a history holds."""
    calls = list(trajectory.llm_calls)
    seen = {id(c) for c in calls}
    for history in trajectory.additional_histories:
        for call in history.llm_calls:
            if id(call) not in seen:
                seen.add(id(call))
                calls.append(call)
    return calls


def pack_trajectory(trajectory: Trajectory, calls: list[LLMCall]) -> str:
    """The trajectory's record: reward, metrics, metadata, versions, its conversations with each Choice a
    reference to the call that sampled it, and which calls each history holds."""
    index = {id(c): i for i, c in enumerate(calls)}
    record: dict[str, Any] = {
        "v": RECORD_VERSION,
        "n": len(trajectory.llm_calls),
        "m": _skeleton(trajectory.messages_and_choices, calls),
        "h": [
            {
                "m": _skeleton(h.messages_and_choices, calls),
                "t": h.tools,
                "c": [index[id(c)] for c in h.llm_calls if id(c) in index],
            }
            for h in trajectory.additional_histories
        ],
        **trajectory.model_dump(
            mode="json",
            include={
                "tools",
                "reward",
                "rewards_by_role",
                "initial_policy_version",
                "final_policy_version",
                "metrics",
                "metadata",
                "logs",
                "start_time",
                "end_time",
            },
        ),
    }
    if not math.isfinite(trajectory.reward):
        record["reward"] = None
    return _compact_record(record)


def _skeleton(items: list[Any], calls: list[LLMCall]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if isinstance(item, Choice):
            ref = _choice_ref(item, calls)
            out.append(ref if ref is not None else {"$choice": item.model_dump(mode="json")})
        else:
            out.append(item)
    return out


def _choice_ref(choice: Choice, calls: list[LLMCall]) -> dict[str, Any] | None:
    """{"$call": [call, choice index]} when the Choice is what `choice_of(call)` rebuilds (same sampled ids)."""
    ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
    if not ids:
        return None
    for i, call in enumerate(calls):
        if call.completion_token_ids == ids and choice.index == 0:
            return {"$call": [i, 0]}
        for other in call.other_choices:
            if other.token_ids == ids and other.index == choice.index:
                return {"$call": [i, other.index]}
    return None


def unpack_trajectory(text: str | dict[str, Any], calls: dict[int, LLMCall]) -> Trajectory:
    """The Trajectory a record describes, its calls (by record index) put back where they were."""
    from ..conversations import choice_of

    record = load_record(text)
    count = record.get("n", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise RecordError(f"a trajectory record's call count is {count!r}, not a count")
    histories = record.get("h") or []
    if not isinstance(histories, list) or not all(isinstance(h, dict) for h in histories):
        raise RecordError("a trajectory record's histories are not a list of objects")
    wanted = set(range(count))
    for h in histories:
        refs = h.get("c") or []
        if not isinstance(refs, list):
            raise RecordError("a history's calls are not a list of indices")
        wanted.update(refs)
    missing = sorted(i for i in wanted if i not in calls)
    if missing:  # never a placeholder: an empty answer would train as a completion nobody sampled
        raise RecordError(
            f"calls {missing[:10]} of the record are missing (their generations not read back: not yet ingested, "
            "or dropped)"
        )
    ordered = [calls[i] for i in sorted(calls)]

    def items(skeleton: Any) -> list[Any]:
        if not isinstance(skeleton, list):
            raise RecordError(f"a conversation in the record is {type(skeleton).__name__}, not a list")
        out: list[Any] = []
        for item in skeleton:
            if isinstance(item, dict) and "$call" in item:
                ref = item["$call"]
                if not (isinstance(ref, list) and len(ref) == 2 and all(type(x) is int for x in ref)):
                    raise RecordError(f"a choice reference is {ref!r}, not [call, choice]")
                i, choice = ref
                rebuilt = choice_of(calls[i], choice) if i in calls else None
                if rebuilt is None:
                    raise RecordError(f"choice {choice} of call {i} is not in the calls read back")
                out.append(rebuilt)
            elif isinstance(item, dict) and "$choice" in item:
                out.append(Choice.model_validate(item["$choice"]))
            else:
                out.append(item)
        return out

    main = [calls[i] for i in range(count)]
    fields = {
        k: record[k]
        for k in (
            "tools",
            "rewards_by_role",
            "initial_policy_version",
            "final_policy_version",
            "metrics",
            "metadata",
            "logs",
            "start_time",
            "end_time",
        )
        if k in record
    }
    reward = record.get("reward")
    return Trajectory(
        messages_and_choices=items(record.get("m") or []),
        additional_histories=[
            History(
                messages_and_choices=items(h.get("m") or []),
                tools=h.get("t"),
                llm_calls=[calls[i] for i in h.get("c") or []],
            )
            for h in histories
        ],
        llm_calls=main if main else ordered,
        reward=float("nan") if reward is None else float(reward),
        **fields,
    )
