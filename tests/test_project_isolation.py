"""Two projects with a model of the same name on one vLLM server: each samples its own weights, and the bare name
they share is withdrawn (a clear 404) instead of serving one project's adapter to the other."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from fixtures_vllm import sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")


async def bare(model: art.TrainableModel) -> httpx.Response:
    """A chat request for the bare name `model.name`, through the model's endpoint (the server's gateway)."""
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(
            f"{model.inference_base_url}/chat/completions",
            headers={"authorization": f"Bearer {model.inference_api_key}"},
            json={"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )


@aio
async def test_same_model_name_in_two_projects_serves_each_its_own_weights(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    backends = [art.LocalBackend(tmp_path / p).use_server(vllm_server) for p in ("a", "b")]
    models = [
        art.TrainableModel(
            name="twin", project=p, base_model=str(vllm_server.base_model), lora=art.LoRAConfig(rank=8)
        )
        for p in ("alpha", "beta")
    ]
    try:
        await models[0].register(backends[0])
        assert models[0].get_inference_name() == "alpha/twin"
        assert (await bare(models[0])).headers["x-art-served-model"] == "alpha/twin@0"  # alone: bare too
        await models[1].register(backends[1])
        assert models[1].get_inference_name() == "beta/twin"
        shared = await bare(models[0])  # shared by two projects: withdrawn, a clear 404
        assert shared.status_code == 404 and "more than one project" in shared.text
        # Interleaved steps with opposite preferences: the two adapters drift apart.
        for model, backend, rewards in [
            (models[0], backends[0], [1.0, 0.0, 1.0, 0.0]),
            (models[1], backends[1], [0.0, 1.0, 0.0, 1.0]),
            (models[0], backends[0], [1.0, 0.0, 1.0, 0.0]),
        ]:
            result = await backend.train(
                model,
                [await sampled_group(model, rewards, "Name a colour", max_tokens=8)],
                learning_rate=5e-3,
                loss_fn="ppo",
            )
            assert result.metrics["trained_tokens"] > 0
        ids = (
            (await sampled_group(models[0], [0.0], "Name a colour"))
            .trajectories[0]
            .messages_and_choices[-1]
            .model_extra["prompt_token_ids"]
        )
        for model, backend in zip(models, backends, strict=True):
            assert await backend.served_logprob_diff(model, ids) <= 1e-4  # each name serves its own trainer
        a_trainer, b_trainer = await backends[0].trainer(models[0]), await backends[1].trainer(models[1])
        a, b = a_trainer.logprobs_of(ids), b_trainer.logprobs_of(ids)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-3  # and the two really differ
        assert (await bare(models[1])).status_code == 404
        await backends[0].close()  # one project goes: the bare name is the other's alone again
        assert (await bare(models[1])).headers["x-art-served-model"] == "beta/twin@1"
    finally:
        for backend in backends:
            await backend.close()
