"""The RL loop through LocalBackend: real vLLM rollouts, real GRPO steps, verified hot-swaps, resume, bad input."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.local import LocalBackend
from art_adapters.capture import capture  # `art.capture` is shadowed by the subpackage once imported
from art_adapters.inference import VLLMServer
from art_adapters.training.loss import RewardError
from art_adapters.training.tokenize import TokenizationError
from fixtures_vllm import registered_on

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")
PROMPTS = ["hi", "Say a number.", "weather?", "Tell me more."]
CONFIG = art.TrainConfig(learning_rate=5e-3)
SWAP_TOLERANCE = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def loop(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[LocalBackend, art.TrainableModel]]:
    async with registered_on(
        vllm_server, tmp_path_factory.mktemp("art"), name="looper", project="loop"
    ) as pair:
        yield pair


async def rollout(model: art.TrainableModel, prompt: str) -> art.Trajectory:
    """A captured rollout; reward = share of bytes in the completion below 'n' (a toy reward with spread)."""
    async with capture() as trajectory:
        response = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=1.0
        )
    text = response.choices[0].message.content or ""
    trajectory.reward = sum(c < "n" for c in text) / max(len(text), 1)
    return trajectory


async def groups_of(model: art.TrainableModel, size: int = 4) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, p) for _ in range(size)) for p in PROMPTS], pbar_desc=None
    )


async def assert_swap_verified(backend: LocalBackend, model: art.TrainableModel, step: int) -> float:
    """vLLM's logprobs of a fixed sequence under `name` and `name@step` equal the trainer's (the new adapter)."""
    trainer = await backend.trainer(model)
    ids = trainer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True, return_dict=False
    ) + [72, 101, 108, 108, 111]
    diffs = [await backend.served_logprob_diff(model, ids, s) for s in (None, step)]
    assert max(diffs) <= SWAP_TOLERANCE, diffs
    return max(diffs)


def paths(backend: LocalBackend, model: art.TrainableModel) -> dict[str, Any]:
    folder = backend.model_dir(model)
    history = checkpoints.read_history(folder)
    return {
        "steps": checkpoints.list_steps(folder),
        "history": len(history),
        "files": sorted(folder.rglob("*.jsonl")),
    }


@aio
async def test_hand_built_trajectory_with_a_choice_trains(
    loop: tuple[LocalBackend, art.TrainableModel],
) -> None:
    """ART's cheat-sheet style: append the Choice the client returned to a Trajectory you built."""
    backend, model = loop
    client = model.openai_client()
    trajectories = []
    for i in range(4):
        messages: list[Any] = [{"role": "user", "content": "Count."}]
        response = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=6, temperature=1.0
        )
        trajectories.append(
            art.Trajectory(messages_and_choices=[*messages, response.choices[0]], reward=float(i))
        )
    step = await model.get_step()
    metrics = await model.train([art.TrajectoryGroup(trajectories)], config=CONFIG)
    assert await model.get_step() == step + 1
    assert metrics["trained_tokens"] > 0 and metrics["skipped_groups"] == 0
    assert abs(metrics["mean_ratio"] - 1.0) < 1e-3  # on-policy: vLLM sampled from the trainer's policy
    await assert_swap_verified(backend, model, step + 1)


@aio
async def test_steps_hot_swap_and_vllm_samples_from_the_new_adapter(
    loop: tuple[LocalBackend, art.TrainableModel],
) -> None:
    backend, model = loop
    folder = backend.model_dir(model)
    for _ in range(3):
        step = await model.get_step()
        groups = await groups_of(model)
        metrics = await model.train(groups, config=CONFIG)
        assert await model.get_step() == step + 1
        # The rollouts came from the adapter served after the previous swap: ratio ~1 before this update.
        assert abs(metrics["mean_ratio"] - 1.0) < 1e-3, metrics
        for key in ("reward_mean", "reward_std", "loss", "grad_norm", "clip_fraction", "trained_tokens"):
            assert math.isfinite(metrics[key]), key
        assert metrics["exception_rate"] == 0.0 and metrics["skipped_groups"] == 0
        await assert_swap_verified(backend, model, step + 1)
        assert (folder / "checkpoints" / f"{step + 1:04d}" / "adapter_model.safetensors").is_file()
        rows = checkpoints.read_history(folder)
        assert rows[-1]["split"] == "train" and rows[-1]["step"] == step
        written = checkpoints.trajectories_path(folder, "train", step).read_text().splitlines()
        assert len(written) == 16 and json.loads(written[0])["llm_calls"][0]["prompt_token_ids"]
    assert not list((folder / "checkpoints").glob(".tmp-*"))


@aio
async def test_bad_rewards_and_foreign_token_ids_fail_clearly_and_write_nothing(
    loop: tuple[LocalBackend, art.TrainableModel],
) -> None:
    backend, model = loop
    groups = await groups_of(model, size=2)
    before, step = paths(backend, model), await model.get_step()
    groups[1].trajectories[1].reward = float("nan")
    with pytest.raises(RewardError, match="group 1, trajectory 1"):
        await model.train(groups, config=CONFIG)
    groups[1].trajectories[1].reward = 0.5
    groups[0].trajectories[0].llm_calls[0].completion_token_ids = [151_643, 151_645]  # Qwen2.5's ids
    with pytest.raises(TokenizationError, match="different tokenizer"):
        await model.train(groups, config=CONFIG)
    assert paths(backend, model) == before and await model.get_step() == step


@aio
async def test_degenerate_groups_complete_and_say_why(
    loop: tuple[LocalBackend, art.TrainableModel], caplog: pytest.LogCaptureFixture
) -> None:
    backend, model = loop
    groups = await groups_of(model, size=2)
    step = await model.get_step()
    lone = art.TrajectoryGroup([groups[0].trajectories[0]])
    metrics = await model.train([lone], config=CONFIG)
    assert metrics["skipped_groups"] == 1 and "skipped_reason" in metrics and metrics["trained_tokens"] == 0
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.reward = 1.0
    metrics = await model.train(groups, config=CONFIG)
    assert metrics["skipped_groups"] == len(groups) and "equal" in metrics["skipped_reason"]
    assert await model.get_step() == step + 2
    await assert_swap_verified(backend, model, step + 2)

    text_only = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    mixed = art.TrajectoryGroup([*groups[0].trajectories, text_only])
    mixed.trajectories[0].reward = 0.0
    with caplog.at_level(logging.WARNING):
        metrics = await model.train([mixed], config=CONFIG)
    assert metrics["skipped_trajectories"] == 1 and metrics["trained_tokens"] > 0
    assert "no sampled token ids" in caplog.text


@aio
async def test_sft_log_and_delete_checkpoints_keep_latest_and_best(
    loop: tuple[LocalBackend, art.TrainableModel], vllm_server: VLLMServer
) -> None:
    backend, model = loop
    step = await model.get_step()
    sft = [
        art.Trajectory(
            messages_and_choices=[{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}]
        )
        for p in PROMPTS
    ]
    metrics = await model.train_sft(sft, art.SFTConfig(batch_size=2, learning_rate=1e-3))
    assert metrics["batches"] == 2 and await model.get_step() == step + 1
    await assert_swap_verified(backend, model, step + 1)
    best = step  # pretend the checkpoint before SFT scored best on validation
    rows = checkpoints.read_history(backend.model_dir(model))
    checkpoints.append_history(backend.model_dir(model), {"step": best, "split": "val", "val/reward": 9.0})
    logged = await model.log(await groups_of(model, size=2), split="val")
    assert (
        0.0 <= logged["val/reward"] <= 1.0
        and len(checkpoints.read_history(backend.model_dir(model))) == len(rows) + 2
    )
    deleted = await model.delete_checkpoints(best_checkpoint_metric="val/reward")
    assert checkpoints.list_steps(backend.model_dir(model)) == [best, step + 1]
    assert 0 in deleted and best not in deleted
    async with httpx.AsyncClient(timeout=30) as client:
        names = {
            m["id"]
            for m in (await client.get(f"{vllm_server.base_url}/models", headers=vllm_server.headers)).json()[
                "data"
            ]
        }
    assert model.get_inference_name(0) not in names and model.get_inference_name(step + 1) in names


@aio
async def test_restart_resumes_step_and_optimizer(
    loop: tuple[LocalBackend, art.TrainableModel], vllm_server: VLLMServer
) -> None:
    backend, model = loop
    old = await backend.trainer(model)
    step = await model.get_step()
    again = art.TrainableModel(**model.model_dump(include={"name", "project", "base_model", "lora"}))
    fresh = LocalBackend(backend.path).use_server(vllm_server)
    await again.register(fresh)
    assert await again.get_step() == step
    new = await fresh.trainer(again)
    assert new is not old and new.step == old.step
    old_state, new_state = old.optimizer.state_dict()["state"], new.optimizer.state_dict()["state"]
    assert old_state.keys() == new_state.keys() and old_state
    for key in old_state:
        assert torch.equal(old_state[key]["exp_avg_sq"], new_state[key]["exp_avg_sq"])
    for (name, a), (_, b) in zip(old.model.named_parameters(), new.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    await assert_swap_verified(fresh, again, step)
    metrics = await again.train(await groups_of(again), config=CONFIG)
    assert await again.get_step() == step + 1 and metrics["trained_tokens"] > 0
    await fresh.close()
    assert vllm_server.running
