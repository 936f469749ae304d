"""Per-agent adapters end to end on the real vLLM server: calls made as agent A (its code calling the model's one
name) are routed to A's adapter, one `model.train` step on them leaves B's checkpointed adapter bit-identical,
and what vLLM serves as A and as B is each one's own trainer weights (the demo's swap check, per agent)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.serving import served_prompt_logprobs
from art_adapters.inference import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")
SWAP_TOLERANCE = 1e-4


async def as_agent(model: art.TrainableModel, agent: str, seed: int) -> art.Trajectory:
    client = model.openai_client()
    async with art.capture() as trajectory:
        with art.role(agent):
            await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": f"Say a word ({seed})."}],
                max_tokens=6,
                seed=seed,
            )
    return trajectory


@aio
async def test_a_step_on_agent_a_trains_a_only_and_each_agent_is_served_its_own_weights(
    vllm_server: VLLMServer, tmp_path
) -> None:
    backend = art.LocalBackend(tmp_path / "art").use_server(vllm_server)
    model = art.TrainableModel(
        name="m",
        project="agents",
        base_model=str(vllm_server.base_model),
        lora=art.LoRAConfig(rank=8, alpha=16),
        adapters=art.PerAgent(by="role", agents=["a", "b"]),
    )
    await model.register(backend)
    try:
        trajectories = [await as_agent(model, "a", k) for k in range(4)]
        assert {t.llm_calls[0].served_model for t in trajectories} == {"agents/m.a@0"}
        for k, trajectory in enumerate(trajectories):
            trajectory.reward = float(k)
        metrics = await model.train([art.TrajectoryGroup(trajectories)], art.TrainConfig(learning_rate=5e-2))
        assert metrics["adapters_trained"] == 1 and metrics["agent/a/trained_tokens"] > 0
        folder = backend.model_dir(model)
        step0, step1 = (checkpoints.checkpoint_dir(folder, s) for s in (0, 1))
        assert checkpoints.checkpoint_agents(step1) == ["a", "b"]

        def tensors(path):
            return load_file(str(path / "adapter_model.safetensors"))

        b0, b1 = tensors(step0 / "agents/b"), tensors(step1 / "agents/b")
        assert b0.keys() == b1.keys() and all(torch.equal(b0[k], b1[k]) for k in b0)  # B: to the bit
        a0, a1 = tensors(step0 / "agents/a"), tensors(step1 / "agents/a")
        assert any(not torch.equal(a0[k], a1[k]) for k in a0)  # A: trained
        call = trajectories[0].llm_calls[0]
        ids = list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])
        for agent in ("a", "b"):  # what vLLM serves as each agent is that agent's trainer weights
            assert await backend.served_logprob_diff(model, ids, agent=agent) <= SWAP_TOLERANCE
        served_a = await served_prompt_logprobs(vllm_server, "agents/m.a@1", ids)
        served_b = await served_prompt_logprobs(vllm_server, "agents/m.b@1", ids)
        assert max(abs(x - y) for x, y in zip(served_a, served_b, strict=True)) > 1e-3  # and they differ
        after = await as_agent(model, "a", 9)
        assert after.llm_calls[0].served_model == "agents/m.a@1"  # the new version, hot-swapped
        shared = await as_agent(model, "nobody", 9)  # not listed: the shared adapter
        assert shared.llm_calls[0].served_model == "agents/m@1"
    finally:
        await backend.close()


@aio
async def test_an_agent_first_seen_mid_run_is_served_by_its_fresh_adapter_once_trained(
    vllm_server: VLLMServer, tmp_path
) -> None:
    backend = art.LocalBackend(tmp_path / "art").use_server(vllm_server)
    model = art.TrainableModel(
        name="m",
        project="open",
        base_model=str(vllm_server.base_model),
        lora=art.LoRAConfig(rank=8, alpha=16),
        adapters=art.PerAgent(by="role"),  # no fixed list: every role gets an adapter
    )
    await model.register(backend)
    try:
        trajectories = [await as_agent(model, "scout", k) for k in range(4)]
        assert {t.llm_calls[0].served_model for t in trajectories} == {"open/m@0"}  # not served yet: shared
        for k, trajectory in enumerate(trajectories):
            trajectory.reward = float(k)
        metrics = await model.train([art.TrajectoryGroup(trajectories)], art.TrainConfig(learning_rate=5e-2))
        assert metrics["agent/scout/trained_tokens"] > 0
        after = await as_agent(model, "scout", 9)
        assert after.llm_calls[0].served_model == "open/m.scout@1"
        call = trajectories[0].llm_calls[0]
        ids = list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])
        assert await backend.served_logprob_diff(model, ids, agent="scout") <= SWAP_TOLERANCE
        assert await model.delete_checkpoints() == [0]  # step 0's versions, the agents' too, leave the engine
        assert "open/m.scout" in backend._registered(model).gateway.models
    finally:
        await backend.close()
