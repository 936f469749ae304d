"""What an inference request may ask of the engine: bounded size, nesting and work, no engine-internal fields.

One check for every door to vLLM (the gateway in front of it, the `serve` proxy in front of that): a request that
could exhaust or kill the engine is refused with a clear 4xx before anything is sent upstream.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..untrusted import nesting_depth

# Fields vLLM accepts that steer the engine itself rather than sampling, and that no rollout needs:
# disaggregated-prefill / encoder-cache transfer state (a deeply nested one kills the engine while it pickles the
# scheduler output), extension arguments, engine request ids (another request's id can collide with it), and a
# Jinja chat template (code the server would run, rendering a prompt the trainer never renders).
ENGINE_FIELDS = frozenset(
    {"kv_transfer_params", "ec_transfer_params", "vllm_xargs", "request_id", "chat_template"}
)
# Output-length fields of the three APIs (chat/completions, Responses, Anthropic Messages).
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class RequestLimits(BaseModel):
    """Per-request bounds (server flags of `art-adapters serve`; `InferenceConfig.limits` for a LocalBackend)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(32 * 2**20, gt=0, description="An inference request's body.")
    max_depth: int = Field(64, gt=0, description="JSON nesting depth of the body (any field).")
    max_n: int = Field(64, gt=0, description="Choices per request (`n`, `best_of`).")
    max_tokens: int | None = Field(
        None, gt=0, description="Output tokens per choice (None: the engine's context length bounds it)."
    )
    max_request_tokens: int = Field(
        262_144,
        gt=0,
        description="n x output tokens per request (a missing max_tokens counts as the context).",
    )


class RequestRejected(ValueError):
    """An inference request refused before it reached the engine; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Any, limit: int) -> bytes:
    """A Starlette request's body, refused (413) at a declared length over `limit`, or as soon as the bytes that
    arrive pass it: never buffered whole first."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestRejected(413, f"request body over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestRejected(413, f"request body over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(body: bytes, limits: RequestLimits, *, context_tokens: int | None = None) -> dict[str, Any]:
    """The request's JSON object, checked: size, nesting depth, `model` a string, `n`/`best_of` and output length
    within the limits (`context_tokens`: the engine's context length, the output bound of a request that gives
    none). Engine-internal fields are removed. Raises RequestRejected."""
    if len(body) > limits.max_body_bytes:
        raise RequestRejected(413, f"request body over the {limits.max_body_bytes}-byte limit")
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestRejected(400, f"request body nested deeper than {limits.max_depth} levels") from None
    except ValueError:
        raise RequestRejected(400, "request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise RequestRejected(400, "request body must be a JSON object")
    if nesting_depth(payload, limits.max_depth) > limits.max_depth:
        raise RequestRejected(400, f"request body nested deeper than {limits.max_depth} levels")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestRejected(400, f"'model' must be a string, not {type(model).__name__}")
    for key in ENGINE_FIELDS & payload.keys():
        del payload[key]
    check_work(payload, limits, context_tokens)
    return payload


def check_work(payload: dict[str, Any], limits: RequestLimits, context_tokens: int | None = None) -> None:
    """Refuse a request asking for more choices or output tokens than the limits allow. A completions `prompt`
    given as a list is that many prompts, each with its `n` choices."""
    n = _count(payload, "n", 1)
    best_of = _count(payload, "best_of", n)
    prompts = prompt_count(payload.get("prompt"))
    per_prompt = max(n, best_of)
    choices = prompts * per_prompt
    asked = f"{prompts} prompts x n={per_prompt}" if prompts != 1 else f"n={per_prompt}"
    if choices > limits.max_n:
        what = f"{asked} = {choices} choices, over" if prompts != 1 else f"{asked} is over"
        raise RequestRejected(400, f"{what} this server's limit of {limits.max_n} choices")
    lengths = [_count(payload, key, 0) for key in _LENGTH_FIELDS if payload.get(key) is not None]
    length = max(lengths) if lengths else None
    if length is not None and limits.max_tokens is not None and length > limits.max_tokens:
        raise RequestRejected(
            400, f"max_tokens={length} is over this server's limit of {limits.max_tokens} per choice"
        )
    per_choice = length if length is not None else context_tokens
    if per_choice is not None and choices * per_choice > limits.max_request_tokens:
        tokens = f"max_tokens={length}" if length is not None else f"no max_tokens (up to {per_choice})"
        raise RequestRejected(
            400,
            f"{asked} x {tokens} asks for more than this server's {limits.max_request_tokens} output "
            "tokens per request; lower n or max_tokens",
        )


def prompt_count(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds: a string or one list of token ids is one; a list of
    strings or of token-id lists is one each."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def _count(payload: dict[str, Any], key: str, default: int) -> int:
    value = payload.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestRejected(400, f"{key!r} must be a non-negative integer, not {value!r}")
    return value
