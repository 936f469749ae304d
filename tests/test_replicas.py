"""Replicated inference on an existing engine: `InferenceConfig(replicas=2)` runs vLLM's own data parallelism (two
engines behind one OpenAI server). A trained step is served by both engines as soon as it is published, every
sampled token's logprob equals the trainer's, whichever engine sampled it, and every call of a multi-turn rollout
lands on the engine its rollout hashes to (its prefix cache)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

import art_adapters as art
from art_adapters.backend.serving import served_prompt_logprobs
from art_adapters.capture.scope import rollout_key
from art_adapters.inference import InferenceConfig
from art_adapters.inference.routing import pick
from art_adapters.tiny import tiny_model_path
from fixtures_vllm import sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train]
TOLERANCE = 1e-4  # as for one engine (test_train_loop's SWAP_TOLERANCE)


async def engine_requests(server: object) -> dict[str, float]:
    """Finished requests per engine, from vLLM's Prometheus metrics (label `engine`)."""
    base = str(server.base_url).removesuffix("/v1")  # type: ignore[attr-defined]
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{base}/metrics", headers=server.headers)).text  # type: ignore[attr-defined]
    counts: dict[str, float] = {}
    for engine, value in re.findall(
        r'vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} ([0-9.e+]+)', text
    ):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


async def test_two_engine_replicas_serve_each_step_token_exact(tmp_path: Path) -> None:
    backend = art.LocalBackend(tmp_path, inference=InferenceConfig(replicas=2, max_num_seqs=8))
    model = art.TrainableModel(
        name="dp",
        project="replicas",
        base_model=str(tiny_model_path()),
        lora=art.LoRAConfig(rank=8, alpha=16),
    )
    await model.register(backend)
    try:
        server = backend._registered(model).server
        assert "--data-parallel-size" in server.command()
        groups = [await sampled_group(model, [1.0, 0.0, 0.5, 0.0])]
        result = await backend.train(model, groups, learning_rate=1e-2)
        assert result.step == 1
        before = await engine_requests(server)

        client = model.openai_client()

        async def sample(k: int) -> tuple[list[int], list[int], list[float]]:
            completion = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": f"Say something ({k})."}],
                max_tokens=8,
                logprobs=True,
                seed=k,
                extra_body={"return_token_ids": True},
            )
            choice = completion.choices[0]
            assert completion.model_extra is not None and choice.logprobs is not None
            lps = [c.logprob for c in choice.logprobs.content or []]
            return completion.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], lps  # type: ignore[index]

        samples = await asyncio.gather(*(sample(k) for k in range(16)))  # concurrent: both engines get some
        after = await engine_requests(server)
        served = {engine: after.get(engine, 0.0) - before.get(engine, 0.0) for engine in after}
        assert sorted(served) == ["0", "1"] and min(served.values()) > 0, served

        trainer = await backend.trainer(model)
        worst = 0.0
        for prompt, ids, lps in samples:
            ours = await asyncio.to_thread(trainer.logprobs_of, prompt + ids, start=len(prompt))
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, lps, strict=True)))
        assert worst <= TOLERANCE, worst  # step 1's adapter on whichever engine sampled
        for k in range(6):  # sequential multi-turn rollouts: each one's calls all on its engine
            before = await engine_requests(server)
            async with art.capture() as trajectory:
                messages = [{"role": "user", "content": f"Tell me about {k}."}]
                for _ in range(3):
                    reply = await client.chat.completions.create(
                        model=model.get_inference_name(), messages=messages, max_tokens=4
                    )
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": "And then?"},
                    ]
            after = await engine_requests(server)
            used = {
                e: after.get(e, 0.0) - before.get(e, 0.0)
                for e in after
                if after.get(e, 0.0) > before.get(e, 0.0)
            }
            assert used == {str(pick(f"{rollout_key(trajectory)}/replica", 2)): 3.0}, used
        prompt, ids, lps = samples[0]
        base = await served_prompt_logprobs(
            server, server.model_name, prompt + ids
        )  # step 0: the base policy
        assert max(abs(a - b) for a, b in zip(base[len(prompt) - 1 :], lps, strict=True)) > 10 * TOLERANCE
    finally:
        await backend.close()
