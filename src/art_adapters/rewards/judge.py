"""How RULER reaches its judge: an art Model, an OpenAI client, or a LiteLLM model string (ART's form).

A model string goes through LiteLLM when it is installed (`pip install 'art-adapters[litellm]'`); without it,
OpenAI-compatible providers (`openai/...`, `hosted_vllm/...`, or a bare name) are reached with the openai SDK
(`api_base`/`api_key` from `extra_litellm_params`, else the provider's environment variables), and any other
provider is a clear error naming the extra.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai

from ..capture.scope import CURRENT

if TYPE_CHECKING:
    from ..model import Model

# Providers reached with the openai SDK when LiteLLM is absent: prefix -> (base-URL env var, key env var).
_OPENAI_COMPATIBLE = {
    "openai": ("OPENAI_BASE_URL", "OPENAI_API_KEY"),
    "hosted_vllm": ("HOSTED_VLLM_API_BASE", "HOSTED_VLLM_API_KEY"),
}
# Judges that accept no temperature of the caller's (OpenAI's o-series and gpt-5 reasoning models).
_REASONING = re.compile(r"(^|/)(o[1-9](-|$)|o[1-9]-mini|gpt-5)", re.IGNORECASE)
# extra_litellm_params that are request fields (the rest go to the request's extra_body).
_REQUEST_FIELDS = {"temperature", "max_tokens", "max_completion_tokens", "top_p", "seed", "reasoning_effort"}


class JudgeUnavailable(RuntimeError):
    """The judge model string names a provider that cannot be reached without LiteLLM."""


def litellm_module() -> ModuleType | None:
    """LiteLLM if installed, imported offline (its price map from the package, not fetched at import)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        return None
    return litellm


@dataclass
class Judge:
    """One judge endpoint: `complete(request)` returns the answer's content."""

    name: str
    client: openai.AsyncOpenAI | None = None
    litellm: ModuleType | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> tuple[str, str]:
        base = str(self.client.base_url) if self.client is not None else str(self.params.get("api_base", ""))
        return base, self.name

    fixed_temperature: bool = False  # a reasoning judge (o-series, gpt-5): it samples at its own temperature

    def __post_init__(self) -> None:
        self.fixed_temperature = self.fixed_temperature or bool(_REASONING.search(self.name))

    async def complete(self, request: dict[str, Any]) -> str | None:
        """The judge's answer. A judge that samples at its own temperature (o-series, gpt-5, or one that refuses
        the one asked for) is asked without one."""
        token = CURRENT.set(None)  # the judge's own call is never recorded into a rollout's trajectory
        try:
            try:
                response = await self._send(request)
            except Exception as error:
                if self.fixed_temperature or "temperature" not in request or "temperature" not in str(error):
                    raise
                self.fixed_temperature = True  # refused: the next calls leave it out from the start
                response = await self._send(request)
        finally:
            CURRENT.reset(token)
        choice = response.choices[0] if response.choices else None
        return choice.message.content if choice else None

    async def _send(self, request: dict[str, Any]) -> Any:
        if self.fixed_temperature:
            request = {k: v for k, v in request.items() if k != "temperature"}
        if self.litellm is not None:
            return await self.litellm.acompletion(
                model=self.name, num_retries=0, **{**request, **self.params}
            )
        assert self.client is not None
        return await self.client.chat.completions.create(**self._openai_request(request))

    def _openai_request(self, request: dict[str, Any]) -> dict[str, Any]:
        out = {**request, "model": self.name}
        extra = dict(out.pop("extra_body", None) or {})
        for key, value in self.params.items():
            if key in _REQUEST_FIELDS:
                out[key] = value
            else:
                extra[key] = value
        if extra:
            out["extra_body"] = extra
        return out


def resolve_judge(
    judge_model: str | Model,
    client: openai.AsyncOpenAI | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
) -> Judge:
    params = dict(extra_litellm_params or {})
    if not isinstance(judge_model, str):
        return Judge(judge_model.get_inference_name(), client or judge_model.openai_client(), params=params)
    if client is not None:
        return Judge(judge_model, client.with_options(max_retries=0), params=params)
    litellm = litellm_module()
    if litellm is not None:
        return Judge(judge_model, litellm=litellm, params=params)
    provider, slash, name = judge_model.partition("/")
    if not slash:
        provider, name = "openai", judge_model
    if provider not in _OPENAI_COMPATIBLE:
        raise JudgeUnavailable(
            f"judge {judge_model!r}: provider {provider!r} needs LiteLLM (pip install 'art-adapters[litellm]'); "
            "without it, use an OpenAI-compatible judge: 'openai/...', 'hosted_vllm/...', client=AsyncOpenAI(...) "
            "or an art.Model"
        )
    base_env, key_env = _OPENAI_COMPATIBLE[provider]
    base_url = params.pop("api_base", None) or params.pop("base_url", None) or os.environ.get(base_env)
    api_key = params.pop("api_key", None) or os.environ.get(key_env)
    if provider == "hosted_vllm" and not base_url:
        raise JudgeUnavailable(
            f"judge {judge_model!r}: no server address; pass extra_litellm_params={{'api_base': URL}} "
            f"or set {base_env}"
        )
    if provider == "hosted_vllm":
        api_key = api_key or "none"
    try:
        judge_client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    except openai.OpenAIError as error:  # e.g. no API key anywhere
        raise JudgeUnavailable(f"judge {judge_model!r}: {error}") from error
    return Judge(name, judge_client, params=params)
