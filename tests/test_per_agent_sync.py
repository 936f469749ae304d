"""Per-agent checkpoints leave the machine whole: each agent's adapter under `checkpoints/{step}/agents/{adapter}/`
is pushed to a real S3 server (moto's) and pulled back, a trainer resumed from the pulled copy holds every agent's
weights and optimizer to the bit, and the vLLM export serves each agent under its own name (or is refused where
one adapter would stand for all)."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.deployment import VLLMExportConfig, deploy_model
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from fixtures_s3 import BUCKET
from test_per_agent_training import CONFIG, LORA, groups_of, same, weights

pytestmark = pytest.mark.train
PER_AGENT = art.PerAgent(by="role", agents=["planner", "executor"])


def trained_folder(root: Path) -> tuple[art.LocalBackend, art.TrainableModel, PerAgentTrainer, Path]:
    """A model folder whose step 1 trained both agents (checkpoints 0 and 1, as LocalBackend writes them)."""
    backend = art.LocalBackend(root)
    model = art.TrainableModel(
        name="team", project="sync", base_model=str(tiny_model_path()), lora=LORA, adapters=PER_AGENT
    )
    folder = backend.model_dir(model)
    trainer = PerAgentTrainer(tiny_model_path(), LORA, per_agent=PER_AGENT, seed=5)
    checkpoints.save_checkpoint(folder, 0, trainer.save)
    metrics = trainer.train_step(groups_of(trainer, ["planner", "executor"]), CONFIG)
    assert metrics["adapters_trained"] == 2
    checkpoints.save_checkpoint(folder, 1, trainer.save)
    return backend, model, trainer, folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


async def test_every_agents_adapter_goes_to_s3_and_a_resume_from_the_copy_restores_each(
    s3_server: object, tmp_path: Path
) -> None:
    backend, model, trainer, folder = trained_folder(tmp_path / "here")
    await backend._experimental_push_to_s3(model)
    keys = {o["Key"] for o in s3_server.list_objects_v2(Bucket=BUCKET)["Contents"]}  # type: ignore[attr-defined]
    for agent in ("planner", "executor"):
        for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt"):
            assert f"sync/models/team/checkpoints/0001/agents/{agent}/{name}" in keys

    elsewhere = art.LocalBackend(tmp_path / "there")
    await elsewhere._experimental_pull_from_s3(model, only_step="latest")
    pulled = checkpoints.checkpoint_dir(elsewhere.model_dir(model), 1)
    assert files_of(pulled) == files_of(checkpoints.checkpoint_dir(folder, 1))
    assert checkpoints.checkpoint_agents(pulled) == ["executor", "planner"]

    resumed = PerAgentTrainer(tiny_model_path(), LORA, per_agent=PER_AGENT, seed=11)  # other initial weights
    resumed.load(pulled)
    assert resumed.step == 1 and resumed.agents == ["executor", "planner"]
    for peft in ("default", "agent_planner", "agent_executor"):
        assert same(weights(trainer, peft), weights(resumed, peft))
    groups = groups_of(trainer, ["planner", "executor"], seed=1)
    a, b = trainer.train_step(groups, CONFIG), resumed.train_step(groups, CONFIG)
    for agent in ("planner", "executor"):  # each agent's optimizer state came back too
        assert a[f"agent/{agent}/loss"] == b[f"agent/{agent}/loss"]
        assert same(weights(trainer, f"agent_{agent}"), weights(resumed, f"agent_{agent}"))


async def test_the_vllm_export_serves_each_agent_and_one_adapter_exports_are_refused(tmp_path: Path) -> None:
    _, model, _, folder = trained_folder(tmp_path / "here")
    checkpoint = str(checkpoints.checkpoint_dir(folder, 1))
    result = await deploy_model(model, checkpoint, 1, "vllm", VLLMExportConfig(out_dir=str(tmp_path / "out")))
    out = Path(result.path or "")
    assert checkpoints.checkpoint_agents(out) == ["executor", "planner"]
    assert not any(name.endswith(("optimizer.pt", "trainer_state.json")) for name in files_of(out))
    for agent in ("planner", "executor"):
        exported = out / "agents" / agent / "adapter_model.safetensors"
        assert exported.read_bytes() == (Path(checkpoint) / "agents" / agent / exported.name).read_bytes()
        assert f"{result.inference_model_name}.{agent}={out / 'agents' / agent}" in (result.command or "")
    assert "--max-loras 3" in (result.command or "")
    merged = VLLMExportConfig(out_dir=str(tmp_path / "merged"), merged=True)
    with pytest.raises(ValueError, match=r"per-agent adapters \['executor', 'planner'\].*merging takes one"):
        await deploy_model(model, checkpoint, 1, "vllm", merged)
    assert not (tmp_path / "merged").exists()
