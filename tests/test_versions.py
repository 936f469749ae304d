"""Versioned weights on the real vLLM server: rollouts keep sampling while three steps train and swap, none fails,
every captured call names the version that sampled it and its logprobs are that version's, old versions leave
the engine once nobody used them for a while, and an async run on LocalBackend records every token's version."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from art_adapters.pipeline import PipelineConfig, train_async
from fixtures_vllm import registered_on, sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train, pytest.mark.asyncio(loop_scope="session")]


async def version_logprobs(
    model: art.TrainableModel, version: int, ids: list[int], start: int
) -> list[float]:
    """The logprobs version `version` gives `ids[start:]`, asked through the model's gateway by its `@step` name
    (which loads a version that was unloaded)."""
    body = {
        "model": f"{model.get_inference_name()}@{version}",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(
            f"{model.inference_base_url}/completions",
            json=body,
            headers={"authorization": f"Bearer {model.inference_api_key}"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-art-policy-version"] == str(version)
    entries = r.json()["choices"][0]["prompt_logprobs"]
    return [entries[i][str(ids[i])]["logprob"] for i in range(start, len(ids))]


async def test_rollouts_in_flight_across_three_swaps_never_fail_and_know_their_version(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="swapper", project="versions") as (backend, model):
        client = model.openai_client()
        calls: list[art.LLMCall] = []
        stop = asyncio.Event()

        async def sampler(k: int) -> None:
            i = 0
            while not stop.is_set():
                async with art.capture() as trajectory:
                    request = {
                        "model": model.name,
                        "messages": [{"role": "user", "content": f"Tell me a story {k}.{i}."}],
                        "max_tokens": 40,
                        "temperature": 1.0,
                    }
                    if i % 2:
                        async for _ in await client.chat.completions.create(**request, stream=True):
                            pass
                    else:
                        await client.chat.completions.create(**request)
                calls.extend(trajectory.llm_calls)
                i += 1

        samplers = [asyncio.create_task(sampler(k)) for k in range(6)]
        for _ in range(3):  # three steps, each swapping in a new version while the samplers run
            group = await sampled_group(model, [1.0, 0.0, 1.0, 0.0], "Name a colour", max_tokens=8)
            await backend.train(model, [group], learning_rate=5e-3, loss_fn="ppo")
        await asyncio.sleep(2.0)  # a few calls on the last version too
        stop.set()
        await asyncio.gather(*samplers)
        assert await model.get_step() == 3

        failed = [
            (c.status_code, c.error, c.policy_version, c.stream)
            for c in calls
            if c.error or c.status_code != 200
        ]
        assert len(calls) >= 24 and not failed, failed[:5]
        assert {c.policy_version for c in calls} == {0, 1, 2, 3}
        assert all(c.served_model == f"versions/swapper@{c.policy_version}" for c in calls)
        # old versions stay while used recently (within the engine's room), then leave; the newest stays
        gateway = vllm_server._gateway  # type: ignore[attr-defined]
        kept, gateway.keep_old_s = gateway.keep_old_s, 0.2
        try:
            await asyncio.sleep(1.5)  # the gateway's sweep runs every 0.5 s
            swapper_versions = [n for n in vllm_server.loras if n.startswith("versions/swapper@")]
            assert swapper_versions == ["versions/swapper@3"]
        finally:
            gateway.keep_old_s = kept
        # each call's logprobs are its own version's, and not another's
        for version in range(4):
            call = next(
                c for c in calls if c.policy_version == version and len(c.completion_token_ids or []) > 4
            )
            prompt, completion = call.prompt_token_ids or [], call.completion_token_ids or []
            own = await version_logprobs(model, version, prompt + completion, len(prompt))
            captured = [x for x in call.logprobs or [] if not math.isnan(x)]
            assert len(captured) == len(completion)
            assert max(abs(a - b) for a, b in zip(own, captured, strict=True)) <= 1e-4
            other = await version_logprobs(model, (version + 1) % 4, prompt + completion, len(prompt))
            assert max(abs(a - b) for a, b in zip(other, captured, strict=True)) > 1e-3


async def test_an_async_run_records_every_tokens_version(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """`train_async` on a LocalBackend: rollouts overlap the steps, the saved trajectories carry the version
    of every call (and ART's spans on their Choices), and staleness stays within its bound."""
    async with registered_on(vllm_server, tmp_path, name="async", project="versions") as (backend, model):

        async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
            return await sampled_group(model, [1.0, 0.0, 0.5], f"Count to {scenario}", max_tokens=6)

        config = PipelineConfig(rollout_workers=3, groups_per_step=2, max_steps_off_policy=1, max_steps=3)
        reports = await train_async(
            model, rollout, range(100), config=art.TrainConfig(learning_rate=1e-3), pipeline=config
        )
    assert [r.step for r in reports] == [1, 2, 3]
    assert all(r.metrics["steps_off_policy"] <= 1 and r.metrics["trained_tokens"] > 0 for r in reports)
    folder = backend.model_dir(model)
    for report in reports:
        rows = (folder / "trajectories" / "train" / f"{report.step:04d}.jsonl").read_text().splitlines()
        for row in map(json.loads, rows):
            choice: dict[str, Any] = row["messages_and_choices"][-1]
            version = choice["policy_version"]
            assert report.step - 1 - version in (0, 1)
            assert choice["policy_token_spans"][0]["policy_version"] == version
            assert choice["policy_token_spans"][0]["end_token"] == len(choice["token_ids"])
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [row["train/steps_off_policy"] for row in history] == [
        r.metrics["steps_off_policy"] for r in reports
    ]
