"""One captured LLM call (`LLMCall`) and the chat-format view of it, whichever API it spoke."""

from __future__ import annotations

import functools
import math
import numbers
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .apis import anthropic as anthropic_api
from .apis import responses as responses_api
from .sources import CallSource

Message = dict[str, Any]
Tools = list[dict[str, Any]]
EndpointKind = Literal["chat", "completions", "responses", "messages"]
# What our inference gateway says of every answer: the policy version (training step) that sampled it and the
# immutable adapter that served it (`{project}/{name}@{step}`).
VERSION_HEADER, SERVED_HEADER = "x-art-policy-version", "x-art-served-model"
# What `serve` says of an answer to its admin key: a recording endpoint refuses to carry that key for rollouts.
KEY_SCOPE_HEADER = "x-art-key-scope"
ROLLOUT_HEADER = (
    "x-art-rollout"  # names a request's rollout, so its calls stay on one engine (inference/routing.py)
)


def policy_token_spans(version: int | None, served: str | None, tokens: int) -> list[dict[str, Any]]:
    """ART's `policy_token_spans`: half-open intervals of a completion's tokens, each sampled by one policy version.
    A served version is immutable while a request runs, so one span covers the whole completion."""
    if version is None or tokens <= 0:
        return []
    return [
        {
            "start_token": 0,
            "end_token": tokens,
            "policy_version": version,
            "lora_slot": served or "",
            "update_seq": 0,
        }
    ]


@functools.lru_cache(maxsize=1024)  # asked for every request and every view of a call, of a few URLs
def endpoint_kind(path: str) -> EndpointKind | None:
    """The API a POST to `path` speaks: OpenAI's chat completions, completions or Responses, Anthropic's Messages
    (vLLM serves all four), or None for any other path."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/v1/messages"):
        return "messages"
    return None


# JSON keeps non-finite numbers (vLLM reports -inf for a token it could not have sampled; a NaN metric) as the
# constants Infinity / -Infinity / NaN, which json.loads and pydantic read back; pydantic's default writes null,
# which no float field reads back.
NON_FINITE_JSON = ConfigDict(ser_json_inf_nan="constants")


class SampledChoice(BaseModel):
    """Token ids and logprobs the engine sampled for one choice of a call (choices after the first when n > 1)."""

    model_config = NON_FINITE_JSON

    index: int
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None


class LLMCall(BaseModel):
    """One OpenAI-compatible exchange as the recording client saw it."""

    model_config = NON_FINITE_JSON

    request: dict[str, Any]
    response: dict[str, Any] | None = None
    url: str = ""
    status_code: int | None = None
    stream: bool = False
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    other_choices: list[SampledChoice] = Field(default_factory=list)
    logprobs_mode: str | None = None
    started_at: float = Field(default_factory=time.time)
    latency_s: float = 0.0
    error: str | None = None
    source: CallSource = Field(default_factory=CallSource)
    policy_version: int | None = Field(
        None,
        description="The training step whose weights sampled this call (from our gateway; None elsewhere).",
    )
    served_model: str | None = Field(None, description="The immutable adapter that served it (`name@step`).")
    reward: float | None = Field(
        None,
        description=(
            "This call's own reward (a turn's reward; None: none given). How it combines with the trajectory's "
            "reward: `TrainConfig.advantage` (docs/training.md, 'Credit per turn')."
        ),
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _finite_reward(cls, value: object) -> float | None:
        return check_call_reward(value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "reward":  # `trajectory.llm_calls[i].reward = x` is checked as a loaded one is
            value = check_call_reward(value)
        super().__setattr__(name, value)

    @property
    def ended_at(self) -> float:
        return self.started_at + self.latency_s

    @property
    def model(self) -> str | None:
        return self.request.get("model")

    @property
    def api(self) -> Literal["chat", "responses", "messages"]:
        """Which API the call spoke (from its URL): OpenAI's chat (or completions), OpenAI's Responses, Anthropic's
        Messages. The chat-format views below work for all."""
        kind = endpoint_kind(self.url)
        return kind if kind == "responses" or kind == "messages" else "chat"

    def request_messages(self) -> list[Message]:
        if self.api != "chat":
            return _api_view(self.api).chat_messages(self.request)
        return list(self.request.get("messages") or [])

    def request_tools(self) -> Tools | None:
        if self.api != "chat":
            return _api_view(self.api).chat_tools(self.request.get("tools"))
        return self.request.get("tools")

    def choices(self) -> list[dict[str, Any]]:
        """The answer's choices in chat-completion form (a Responses or Messages answer is one choice)."""
        if not self.response:
            return []
        if self.api != "chat":
            choice = _api_view(self.api).chat_choice(self.response)
            return [choice] if choice is not None else []
        return [c for c in self.response.get("choices") or [] if isinstance(c, dict)]

    def policy_token_spans(self, index: int = 0) -> list[dict[str, Any]]:
        """ART's form of `policy_version` for choice `index`: which version sampled which of its tokens."""
        ids = (
            self.completion_token_ids
            if index == 0
            else next((c.token_ids for c in self.other_choices if c.index == index), None)
        )
        return policy_token_spans(self.policy_version, self.served_model, len(ids or []))

    def response_message(self, index: int = 0) -> Message | None:
        """The assistant message of choice `index`, as a request-ready dict (None if the call failed)."""
        for choice in self.choices():
            if choice.get("index", 0) == index:
                message = dict(choice.get("message") or {})
                return {k: v for k, v in message.items() if v is not None}
        return None


def check_call_reward(value: object) -> float | None:
    """A call's reward as a float: a finite number (a real number: numpy's scalars too, as a trajectory's reward
    takes them; not a bool), or None (no reward); anything else is a ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a call's reward is a finite number or None, not {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(
            f"a call's reward is a finite number, not an integer of {len(str(value))} digits"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"a call's reward is a finite number, not {number}")
    return number


def _api_view(api: str) -> Any:
    """The module giving the chat-format view of a Responses or Messages call."""
    return responses_api if api == "responses" else anthropic_api
