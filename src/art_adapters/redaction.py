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
    if isinstance(value, str):
        return _SECRET_TEXT.sub(REDACTED, value) if value else value
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and k.lower() in SECRET_KEYS and v else scrub(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def _scrub_call(call: LLMCall) -> LLMCall:
    return call.model_copy(
        update={
            "request": scrub(call.request),
            "response": scrub(call.response),
            "url": scrub(call.url),
            "error": scrub(call.error),
        }
    )


def _scrub_items(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if isinstance(item, Choice):
            out.append(Choice.model_validate(scrub(item.model_dump(mode="json"))))
        else:
            out.append(scrub(item))
    return out


def drop_secrets(trajectory: Trajectory) -> Trajectory:
    """The default redaction: API keys, bearer tokens and Authorization headers blanked in requests, responses,
    URLs, messages, metadata and logs. Token ids and logprobs are left as they are (they hold no text)."""
    scrubbed = {id(c): _scrub_call(c) for c in trajectory.llm_calls}

    def calls(of: list[LLMCall]) -> list[LLMCall]:
        return [scrubbed.get(id(c)) or _scrub_call(c) for c in of]

    return trajectory.model_copy(
        update={
            "messages_and_choices": _scrub_items(trajectory.messages_and_choices),
            "tools": scrub(trajectory.tools),
            "llm_calls": calls(trajectory.llm_calls),
            "additional_histories": [
                History(
                    messages_and_choices=_scrub_items(h.messages_and_choices),
                    tools=scrub(h.tools),
                    llm_calls=calls(h.llm_calls),
                )
                for h in trajectory.additional_histories
            ],
            "metadata": scrub(dict(trajectory.metadata)),
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
