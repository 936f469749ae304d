"""ART >= 0.5.18's `backend.train(model, groups, ...)` on the real LocalBackend (shared vLLM server, tiny model):
a step that trains nothing still advances (the last checkpoint's folder renamed to it, as ART's step-skipping
test expects, while the version it served keeps answering), a step that trains changes the served weights, and
nothing is logged until `model.log`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

import art_adapters as art
from art_adapters.inference import VLLMServer
from fixtures_vllm import registered_on, sampled_group

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def registered(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[art.LocalBackend, art.TrainableModel]]:
    async with registered_on(
        vllm_server, tmp_path_factory.mktemp("art"), name="agent", project="compat"
    ) as pair:
        yield pair


@aio
async def test_backend_train_skips_advance_and_trains_change_weights(
    registered: tuple[art.LocalBackend, art.TrainableModel],
) -> None:
    backend, model = registered
    folder = backend.model_dir(model)
    start = await model.get_step()
    before = folder / "checkpoints" / f"{start:04d}"
    files = {
        n: (before / n).read_bytes()
        for n in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt")
    }
    groups = [await sampled_group(model, [0.5, 0.5, 0.5])]
    result = await backend.train(model, groups, learning_rate=1e-3)
    assert isinstance(result, art.LocalTrainResult) and result.step == start + 1 == await model.get_step()
    assert result.metrics["trained_tokens"] == 0
    after = Path(result.checkpoint_path or "")
    assert after == folder / "checkpoints" / f"{start + 1:04d}" and not before.exists()  # moved, not copied
    for name, data in files.items():
        assert (after / name).read_bytes() == data, name
    assert json.loads((after / "trainer_state.json").read_text())["step"] == start + 1
    client = model.openai_client()
    for version in (start, start + 1):  # the moved version still answers by its name, as the new one does
        answer = await client.chat.completions.with_raw_response.create(
            model=model.get_inference_name(step=version),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
        )
        assert answer.headers["x-art-policy-version"] == str(version)
    assert (
        not (folder / "history.jsonl").exists()
        or '"split": "train"' not in (folder / "history.jsonl").read_text()
    )

    groups = [await sampled_group(model, [0.0, 1.0, 0.0, 1.0])]
    result = await backend.train(model, groups, learning_rate=1e-3, loss_fn="ppo")
    assert result.step == start + 2 and result.metrics["trained_tokens"] > 0
    trained = folder / "checkpoints" / f"{start + 2:04d}" / "adapter_model.safetensors"
    assert trained.read_bytes() != (after / "adapter_model.safetensors").read_bytes()
    ids = groups[0].trajectories[1].messages_and_choices[-1].model_extra["prompt_token_ids"]
    assert await backend.served_logprob_diff(model, ids) <= 1e-4  # vLLM serves what was trained

    row = await model.log(groups, metrics=result.metrics, step=result.step, split="train")
    assert row["train/trained_tokens"] > 0
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert history[-1]["step"] == start + 2 and history[-1]["split"] == "train"


def plain_group() -> art.TrajectoryGroup:
    """ART-style rollouts that append plain assistant messages (no Choice, no logprobs)."""
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": answer},
            ],
            reward=reward,
        )
        for answer, reward in (("red", 1.0), ("I cannot", 0.0), ("blue", 1.0))
    )


@aio
async def test_a_step_without_logprobs_reports_itself_once_and_arts_setting_trains_it(
    registered: tuple[art.LocalBackend, art.TrainableModel], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37: such a step advances with one warning (not one per trajectory) and certifies nothing; ART's
    `allow_training_without_logprobs=True` trains the same rollouts (re-rendered by the chat template)."""
    backend, model = registered
    start = await model.get_step()
    with caplog.at_level("WARNING"):
        result = await backend.train(model, [plain_group(), plain_group()])
    assert result.step == start + 1
    metrics = result.metrics
    assert metrics["trained_tokens"] == 0 and metrics["sampled_token_fraction"] == 0.0
    assert metrics["skipped_trajectories"] == metrics["skipped_no_sampled_ids"] == 6
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("art_adapters")]
    assert len(warnings) == 1 and "trained nothing" in warnings[0] and "2 group(s)" in warnings[0]

    metrics = await model.train(
        [plain_group()], _config=art.dev.TrainConfig(allow_training_without_logprobs=True)
    )
    assert await model.get_step() == start + 2
    assert metrics["trained_tokens"] > 0 and metrics["sampled_token_fraction"] == 0.0
