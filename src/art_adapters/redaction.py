"""Redaction before anything is stored or imported: a hook `(Trajectory) -> Trajectory | None` (None drops it), and
the default, `drop_secrets`, which blanks API keys, tokens and Authorization headers wherever they appear."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from openai.types.chat.chat_completion import Choice

from .calls import LLMCall
from .trajectories import History, Trajectory

Redactor = Callable[[Trajectory], "Trajectory | None"]
REDACTED = "[REDACTED]"

SECRET_KEYS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "api_key",
        "api-key",
        "apikey",
        "x-api-key",
        "openai_api_key",
        "anthropic_api_key",
        "secret",
        "secret_key",
        "client_secret",
        "password",
        "access_token",
        "refresh_token",
        "cookie",
        "set-cookie",
    }
)
_SECRET_TEXT = re.compile(
    r"(?i:bearer\s+[A-Za-z0-9._~+/=-]{8,})"  # an Authorization header's value
    r"|(?i:basic\s+[A-Za-z0-9+/=]{12,})"
    r"|\b(?:sk|pk)-lf-[A-Za-z0-9-]{8,}"  # Langfuse keys
    r"|\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}"  # OpenAI / Anthropic keys
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"  # GitHub tokens
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
    r"|(?i:(?<=[?&])(?:api[-_]?key|key|token|access_token)=[^&#\s]+)"  # keys in URLs
)


def scrub(value: Any) -> Any:
    """`value` with secret-named fields blanked and secret-looking text replaced (new containers; input untouched)."""
    return _scrub(value, _Hits())


class _Hits:
    """How many secrets a scrub replaced (a call whose text changed has its token ids dropped)."""

    def __init__(self) -> None:
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0


def _scrub(value: Any, hits: _Hits) -> Any:
    if isinstance(value, str):
        if not value:
            return value
        out, n = _SECRET_TEXT.subn(REDACTED, value)
        hits.count += n
        return out
    if isinstance(value, dict):
        out_dict: dict[Any, Any] = {}
        for k, v in value.items():
            if isinstance(k, str) and k.lower() in SECRET_KEYS and v:
                hits.count += v != REDACTED
                out_dict[k] = REDACTED
            else:
                out_dict[k] = _scrub(v, hits)
        return out_dict
    if isinstance(value, list):
        return [_scrub(v, hits) for v in value]
    return value


# Where a body or a Choice carries token ids or per-token logprobs (with the tokens' text): vLLM's chat and
# completions answers (`prompt_token_ids`, `token_ids`, `logprobs` with `top_logprobs`), the Responses API's
# (`input_messages[].tokens`, `output_messages[].tokens`, `output[].content[].logprobs`).
_ID_KEYS = frozenset(
    {"prompt_token_ids", "token_ids", "tokens", "logprobs", "top_logprobs", "prompt_logprobs"}
)


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in _ID_KEYS}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _scrub_call(call: LLMCall) -> tuple[LLMCall, bool]:
    """The call scrubbed, and whether any of its text changed. Token ids decode back to the text they encode, so
    a changed prompt drops the prompt ids, a changed answer the sampled ids and logprobs (of every choice), and
    either drops the copies in the response body: the call no longer carries ids of what it sampled and never
    trains as sampled (re-rendered redacted text only, with `train_retokenized_text` or SFT)."""
    prompt, answer = _Hits(), _Hits()
    update: dict[str, Any] = {
        "request": _scrub(call.request, prompt),
        "response": _scrub(call.response, answer),
        "url": scrub(call.url),
        "error": scrub(call.error),
    }
    if prompt or answer:
        update["response"] = _without_ids(update["response"])
    if prompt:
        update["prompt_token_ids"] = None
    if answer:
        update["completion_token_ids"] = None
        update["logprobs"] = None
        update["other_choices"] = [
            c.model_copy(update={"token_ids": None, "logprobs": None}) for c in call.other_choices
        ]
    return call.model_copy(update=update), bool(prompt or answer)


def _scrub_items(items: list[Any], prompt_changed: bool, dropped: list[int]) -> list[Any]:
    """The conversation scrubbed. A Choice (or a Choice's dict) whose own text or any text before it changed (its
    prompt: `prompt_changed` for the tools, or an earlier item) loses its sampled ids, prompt ids and logprobs."""
    out: list[Any] = []
    for item in items:
        hits = _Hits()
        if isinstance(item, Choice):
            data = _scrub(item.model_dump(mode="json"), hits)
            prompt_changed = prompt_changed or bool(hits)
            if prompt_changed and _carries_ids(data):
                data, dropped[0] = _without_ids(data), dropped[0] + 1
            out.append(Choice.model_validate(data))
        else:
            data = _scrub(item, hits)
            prompt_changed = prompt_changed or bool(hits)
            if prompt_changed and isinstance(data, dict) and _carries_ids(data):
                data, dropped[0] = _without_ids(data), dropped[0] + 1
            out.append(data)
    return out


def _carries_ids(data: dict[str, Any]) -> bool:
    return any(data.get(k) is not None for k in _ID_KEYS)


def drop_secrets(trajectory: Trajectory) -> Trajectory:
    """The default redaction: API keys, bearer tokens and Authorization headers blanked in requests, responses,
    URLs, messages, metadata and logs. Token ids decode back to text, so where a redaction changed a call's text
    its ids go too (a changed prompt: the prompt ids; a changed answer: the sampled ids and logprobs), and a Choice
    of the conversation whose text or earlier text changed loses its ids and logprobs: none of those trains as
    sampled again, and `metadata["redacted_token_ids"]` counts the calls and Choices that lost them."""
    dropped = [0]
    scrubbed: dict[int, LLMCall] = {}
    for c in [*trajectory.llm_calls, *(c for h in trajectory.additional_histories for c in h.llm_calls)]:
        if id(c) not in scrubbed:
            scrubbed[id(c)], changed = _scrub_call(c)
            dropped[0] += changed

    def calls(of: list[LLMCall]) -> list[LLMCall]:
        return [scrubbed[id(c)] for c in of]

    def items(of: list[Any], tools: Any) -> tuple[list[Any], Any]:
        hits = _Hits()
        scrubbed_tools = _scrub(tools, hits)
        return _scrub_items(of, bool(hits), dropped), scrubbed_tools

    main, tools = items(trajectory.messages_and_choices, trajectory.tools)
    histories = []
    for h in trajectory.additional_histories:
        conversation, history_tools = items(h.messages_and_choices, h.tools)
        histories.append(
            History(messages_and_choices=conversation, tools=history_tools, llm_calls=calls(h.llm_calls))
        )
    metadata = scrub(dict(trajectory.metadata))
    if dropped[0]:
        before = metadata.get("redacted_token_ids")
        counted = before if isinstance(before, int) and not isinstance(before, bool) else 0
        metadata["redacted_token_ids"] = counted + dropped[0]
    return trajectory.model_copy(
        update={
            "messages_and_choices": main,
            "tools": tools,
            "llm_calls": calls(trajectory.llm_calls),
            "additional_histories": histories,
            "metadata": metadata,
            "logs": scrub(list(trajectory.logs)),
        }
    )


def apply(redact: Redactor | None, trajectory: Trajectory) -> Trajectory | None:
    """Run the hook (None: keep as is); a hook that returns something else than a Trajectory or None is an error."""
    if redact is None:
        return trajectory
    out = redact(trajectory)
    if out is not None and not isinstance(out, Trajectory):
        raise TypeError(f"a redaction hook returns a Trajectory or None, not {type(out).__name__}")
    return out


__all__ = ["REDACTED", "Redactor", "apply", "drop_secrets", "scrub"]
