"""Unexpected folders under a checkpoint's `agents/` (a copy restored from S3, a hand-made folder): the docs promise
that any folder there whose name is not an adapter name is ignored. `shared` is not an adapter name (it is the
shared adapter's name in the metrics): a folder `agents/shared/` must be ignored too, not break the resume, the
serving of the step or the export."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.base import InferenceEndpoint
from art_adapters.backend.proxy import InferenceProxy
from art_adapters.deployment import VLLMExportConfig, deploy_model
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from test_per_agent_training import LORA

PER_AGENT = art.PerAgent(by="role", agents=["planner"])


def hand_made(root: Path) -> Path:
    """A checkpoint whose `agents/` holds, beside planner's adapter, copies of it named `shared` and `x y`."""
    checkpoint = root / "checkpoints" / "0000"
    planner = checkpoint / "agents" / "planner"
    planner.mkdir(parents=True)
    (planner / "adapter_config.json").write_text("{}")
    (checkpoint / "adapter_config.json").write_text('{"r": 8}')
    for odd in ("shared", "x y"):
        shutil.copytree(planner, checkpoint / "agents" / odd)
    return checkpoint


def test_a_folder_named_shared_is_not_an_agent(tmp_path: Path) -> None:
    assert checkpoints.checkpoint_agents(hand_made(tmp_path)) == ["planner"]


def test_the_servers_proxy_reaches_no_agent_named_shared() -> None:
    proxy = InferenceProxy()
    proxy.add(
        "p",
        "m",
        InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="k", model_name="p/m"),
        agents=True,
    )
    assert proxy.resolve("p/m.planner@2")[1] == "p/m.planner@2"  # type: ignore[index]
    assert "'shared' is not an adapter name" in str(proxy.resolve("p/m.shared"))


async def test_the_export_of_a_checkpoint_with_odd_agent_folders_serves_only_the_agents(
    tmp_path: Path,
) -> None:
    model = art.TrainableModel(
        name="team", project="p", base_model=str(tiny_model_path()), adapters=PER_AGENT
    )
    checkpoint = hand_made(tmp_path / "model")
    result = await deploy_model(
        model, str(checkpoint), 0, "vllm", VLLMExportConfig(out_dir=str(tmp_path / "out"))
    )
    command = result.command or ""
    assert f"{result.inference_model_name}.planner=" in command
    assert ".shared=" not in command and "--max-loras 2" in command


@pytest.mark.train
def test_a_trainer_resumes_a_checkpoint_holding_agents_shared(tmp_path: Path) -> None:
    trainer = PerAgentTrainer(tiny_model_path(), LORA, per_agent=PER_AGENT, seed=5)
    checkpoints.save_checkpoint(tmp_path, 0, trainer.save)
    checkpoint = checkpoints.checkpoint_dir(tmp_path, 0)
    shutil.copytree(checkpoint / "agents" / "planner", checkpoint / "agents" / "shared")
    resumed = PerAgentTrainer(tiny_model_path(), LORA, per_agent=art.PerAgent(by="role"), seed=5)
    resumed.load(checkpoint)
    assert resumed.agents == ["planner"]
