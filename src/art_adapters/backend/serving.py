"""How a registered model's checkpoints are served by the vLLM server: its names (`{project}/{name}`, and the bare
`name` while no other project on that server uses it), loading each step, and reading back what vLLM serves."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..model import TrainableModel

if TYPE_CHECKING:
    from ..inference import VLLMServer
    from ..training.trainer import Trainer

log = logging.getLogger("art_adapters.backend.local")


@dataclass
class Registered:
    """What the backend holds for one registered TrainableModel."""

    model: TrainableModel
    directory: Path
    server: VLLMServer
    trainer: Trainer | None
    step: int
    served: set[int] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bare: bool = False  # also served under the bare `name` (no other project on this server uses it)

    @property
    def name(self) -> str:
        """The adapter's served name: `{project}/{name}`, so projects sharing a server never share weights."""
        return f"{self.model.project}/{self.model.name}"

    def names(self, step: int | None = None) -> list[str]:
        """Every name step `step` (None: the latest) is served under."""
        bases = [self.name] + ([self.model.name] if self.bare else [])
        return bases if step is None else [f"{b}@{step}" for b in bases]


async def claim_bare_name(state: Registered, others: list[Registered]) -> None:
    """Serve the bare `name` too (ART code often sends `model.name`) unless another project on this server has
    a model of that name: then the bare name is withdrawn from all of them, so a request for it fails loudly
    instead of sampling another project's weights."""
    claims = state.server.bare_claims.setdefault(state.model.name, set())
    claims.add(str(state.directory))
    state.bare = claims == {str(state.directory)}
    if state.bare:
        return
    for other in others:  # the same backend's; other backends see the claim when they next serve
        if other.bare and other.model.name == state.model.name:
            other.bare = False
    bare = state.model.name
    for name in [n for n in state.server.loras if n == bare or n.startswith(f"{bare}@")]:
        await state.server.unload_lora(name)
    log.warning(
        "model name %r is used by more than one project on this server: it is served only as "
        "'{project}/%s' (use model.get_inference_name())",
        bare,
        bare,
    )


def release_bare_claims(states: list[Registered]) -> None:
    for state in states:
        claims = state.server.bare_claims.get(state.model.name)
        if claims is not None:
            claims.discard(str(state.directory))


async def serve_step(state: Registered, step: int) -> None:
    """Load `checkpoints/{step}` as `{project}/{name}@step` and (re)load it as `{project}/{name}` (and under the
    bare `name`, while this project alone uses it on the server)."""
    from ..inference import InferenceServerError
    from ..training import checkpoints

    path = checkpoints.checkpoint_dir(state.directory, step)
    if state.bare and state.server.bare_claims.get(state.model.name) != {str(state.directory)}:
        state.bare = False  # another backend on this server registered the same name since
    try:
        for name in state.names(step):
            await state.server.load_lora(name, path)
    except InferenceServerError as error:
        if state.model.lora.modules_to_save:
            error.add_note(
                f"LoRAConfig.modules_to_save={state.model.lora.modules_to_save}: vLLM 0.32 serves no lm_head "
                "adapter for many architectures (Qwen2 among them); train without modules_to_save"
            )
        raise
    for name in state.names():
        await state.server.load_lora(name, path)  # re-use: reloaded in place, prefix cache reset
    state.served.add(step)


def required_lora_rank(base_model: Path, model: TrainableModel) -> int:
    """The `--max-lora-rank` serving this model's adapter needs (a trained lm_head ships as a rank-hidden delta)."""
    from ..training.adapter_io import vllm_max_lora_rank

    rank = model.lora.rank
    if model.lora.modules_to_save:
        config = json.loads((base_model / "config.json").read_text())
        rank = max(
            rank, int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size", rank))
        )
    return vllm_max_lora_rank(rank)


async def served_prompt_logprobs(server: VLLMServer, model_name: str, token_ids: list[int]) -> list[float]:
    """vLLM's logprob of each `token_ids[i]` (i >= 1) given `token_ids[:i]`, under the served `model_name`."""
    import httpx

    body = {
        "model": model_name,
        "prompt": list(token_ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    async with httpx.AsyncClient(timeout=120.0) as client:
        response = await client.post(f"{server.base_url}/completions", json=body, headers=server.headers)
    response.raise_for_status()
    data = response.json()
    entries = data["choices"][0].get("prompt_logprobs") or data.get("prompt_logprobs")
    out = []
    for entry, token in zip(entries[1:], token_ids[1:], strict=True):
        out.append(float(entry[str(token)]["logprob"]))
    return out
