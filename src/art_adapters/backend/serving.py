"""How a registered model's checkpoints are served: each step as an immutable version behind the server's gateway
(`{project}/{name}@{step}`; the model's names point at the newest), and reading back what vLLM serves."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agent_adapters import UnsupportedPerAgentSetting, served_name
from ..model import TrainableModel

if TYPE_CHECKING:
    from ..inference import InferenceConfig, VLLMServer
    from ..inference.gateway import Gateway
    from ..training.sharded import ShardedTrainer
    from ..training.trainer import Trainer

log = logging.getLogger("art_adapters.backend.local")


@dataclass
class Registered:
    """What the backend holds for one registered TrainableModel."""

    model: TrainableModel
    directory: Path
    server: VLLMServer
    gateway: Gateway
    trainer: Trainer | ShardedTrainer | None
    step: int
    lock: asyncio.Lock
    abandoned: asyncio.Future[Any] | None = None  # a step whose caller went away, still running in its thread

    @property
    def name(self) -> str:
        """The model's served name: `{project}/{name}`, so projects sharing a server never share weights (the bare
        `name` answers too while no other project on that server uses it)."""
        return f"{self.model.project}/{self.model.name}"


async def publish_step(state: Registered, step: int) -> None:
    """Serve `checkpoints/{step}` as the model's newest version (`{project}/{name}@{step}`), and with per-agent
    adapters each agent's `checkpoints/{step}/agents/{adapter}` as `{project}/{name}.{adapter}@{step}`; then
    capture routes those agents' calls to them."""
    from .. import checkpoints
    from ..inference import InferenceServerError

    path = checkpoints.checkpoint_dir(state.directory, step)
    try:
        await state.gateway.publish(state.name, state.model.name, step, path)
    except InferenceServerError as error:
        if state.model.lora.modules_to_save:
            error.add_note(
                f"LoRAConfig.modules_to_save={state.model.lora.modules_to_save}: vLLM 0.32 serves no lm_head "
                "adapter for many architectures (Qwen2 among them); train without modules_to_save"
            )
        raise
    if state.model.adapters is None:
        return
    agents = checkpoints.checkpoint_agents(path)
    for adapter in agents:
        await state.gateway.publish(
            served_name(state.name, adapter),
            served_name(state.model.name, adapter),
            step,
            checkpoints.agent_checkpoint_dir(path, adapter),
        )
    state.model.route_agents(state.name, agents)


def agent_keys(state: Registered, step: int | None = None) -> list[str]:
    """The served keys of the model's agents' adapters (`{project}/{name}.{adapter}`) its gateway knows (those of
    checkpoint `step` when given)."""
    from .. import checkpoints

    if state.model.adapters is None:
        return []
    if step is not None:
        adapters = checkpoints.checkpoint_agents(checkpoints.checkpoint_dir(state.directory, step))
        return [served_name(state.name, a) for a in adapters]
    prefix = state.name + "."
    return [key for key in state.gateway.models if key.startswith(prefix)]


def engine_adapter_room(max_loras: int, model: TrainableModel) -> int | None:
    """How many adapters of this model (the shared one included) the engine can hold while one more loads; a
    ValueError with the numbers when a fixed `PerAgent(agents=...)` list does not fit. None without PerAgent."""
    if model.adapters is None:
        return None
    room = max_loras - 1
    listed = len(model.adapters.listed())
    if listed and listed + 1 > room:
        raise UnsupportedPerAgentSetting(
            f"model {model.name!r}: PerAgent(agents=...) lists {listed} agents, so {listed + 1} adapters (with the "
            f"shared one) are served at once, plus one loading: max_loras >= {listed + 2}, but the engine has "
            f"max_loras={max_loras}; raise it: InferenceConfig(max_loras=...) or the model's "
            "inference={'max_loras': ...} with a LocalBackend, `art-adapters serve --max-loras N` on a server"
        )
    return room


def check_agent_room(state: Registered, max_loras: int | None, groups: list[Any]) -> None:
    """Before a step starts: the agents its calls would add must fit the engine with those already held, else
    UnsupportedPerAgentSetting with the numbers (the trainer refuses them too, but a server answers a 400 first)."""
    from .. import checkpoints
    from ..agent_adapters import SHARED

    per_agent = state.model.adapters
    if per_agent is None or max_loras is None:
        return
    room = engine_adapter_room(max_loras, state.model) or 0
    trainer_agents = getattr(state.trainer, "agents", None)
    held = set(
        trainer_agents
        if trainer_agents is not None
        else checkpoints.checkpoint_agents(checkpoints.checkpoint_dir(state.directory, state.step))
    )
    calls = (c for g in groups for t in g.trajectories for c in t.llm_calls)
    wanted = held | set(per_agent.listed()) | ({per_agent.adapter_of(c.source) for c in calls} - {SHARED})
    if len(wanted) + 1 > room:
        raise UnsupportedPerAgentSetting(
            f"model {state.model.name!r}: this step's calls come from {len(wanted - held)} agents without an "
            f"adapter yet; with the {len(held)} held and the shared one that is {len(wanted) + 1} adapters, but "
            f"the engine serves at most {room} at once (max_loras={max_loras} less one loading): raise max_loras "
            "(InferenceConfig, or `art-adapters serve --max-loras N`), or list the agents in PerAgent(agents=...)"
        )


BASE_ADAPTER = "base-adapter"  # in the model folder: step 0 rebuilt once its checkpoint is gone


def servable_steps(directory: Path) -> list[int]:
    """The steps that can be served: every checkpoint on disk, and step 0 (the base model) once there is one."""
    from .. import checkpoints

    steps = checkpoints.list_steps(directory)
    return sorted({0, *steps}) if steps else []


async def serve_checkpoint(state: Registered, step: int) -> str:
    """Serve `checkpoints/{step}` as a version of its own without moving the model's names off the newest; returns
    the name that reaches it. Step 0 is the base model: its checkpoint (LoRA's zero-update initial adapter), or,
    when that was deleted, the newest checkpoint with every LoRA B matrix zeroed (the same zero update). A step
    with no checkpoint is refused, naming those there are."""
    from .. import checkpoints

    path = checkpoints.checkpoint_dir(state.directory, step)
    if not path.is_dir():
        have = checkpoints.list_steps(state.directory)
        if step != 0 or not have:
            raise ValueError(
                f"model {state.model.name!r} has no checkpoint of step {step} (its checkpoints: {have})"
            )
        path = state.directory / BASE_ADAPTER
        if not path.is_dir():
            source = checkpoints.checkpoint_dir(state.directory, have[-1])
            await asyncio.to_thread(write_zero_adapter, source, path)
    await state.gateway.publish(state.name, state.model.name, step, path)
    return f"{state.name}@{step}"


def write_zero_adapter(source: Path, target: Path) -> None:
    """`source`'s served adapter with every LoRA B matrix zeroed: its update is exactly zero, so it answers as the
    base model (a trained lm_head is served as a LoRA delta too, see training/adapter_io.py). Written atomically."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    from ..training.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    tensors = load_file(str(source / ADAPTER_WEIGHTS))
    zeroed = {
        k: torch.zeros_like(v) if ".lora_B." in k or ".lora_embedding_B" in k else v
        for k, v in tensors.items()
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_file(zeroed, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(source / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


MAX_AUTO_SIZED_AGENTS = 16  # 2 x (16 + 1) = 34 LoRA slots: past that the engine's size is its owner's call


def sized_for_agents(config: InferenceConfig, model: TrainableModel) -> InferenceConfig:
    """A fixed `PerAgent(agents=...)` list of N: `max_loras` at least 2 x (N + 1) unless set (each adapter's newest
    version and one older still in flight); a setting too small is refused at registration (`engine_adapter_room`)."""
    listed = len(model.adapters.listed()) if model.adapters is not None else 0
    wanted = 2 * (listed + 1)
    if listed and "max_loras" not in config.model_fields_set and config.max_loras < wanted:
        if listed > MAX_AUTO_SIZED_AGENTS:  # a caller's list alone never sizes the engine past this
            raise UnsupportedPerAgentSetting(
                f"PerAgent(agents=...) lists {listed} agents; the engine is sized for at most "
                f"{MAX_AUTO_SIZED_AGENTS} listed agents unless max_loras is set (each agent holds LoRA slots on the "
                f"engine and an optimizer in the trainer): set max_loras >= {wanted} yourself "
                "(InferenceConfig(max_loras=...) with a LocalBackend, `art-adapters serve --max-loras N` on a server)"
            )
        return config.model_copy(update={"max_loras": wanted})
    return config


async def forget_all(state: Registered, steps: list[int] | None = None) -> None:
    """Stop serving `steps` (None: all) of the model and of its agents' adapters."""
    for key in [state.name, *agent_keys(state)]:
        await state.gateway.forget(key, steps)
