"""Per-agent adapters on the sharded trainer (FSDP2, 2 processes, gloo on this CPU), against the one-process
`PerAgentTrainer` on the same data, seed and starting checkpoint: one step trains the shared adapter and each
agent's to the same weights (fp32, within 1e-6 at lr 1e-4, as tests/test_sharded_training.py for one adapter) in
the same checkpoint files; a step on agent a's calls leaves b's adapter and AdamW moments, and the shared one's,
bit-identical; a checkpoint resumes every agent in new processes (weights and moments to the bit); and through
LocalBackend's trainer management, a rank SIGKILLed mid-step (after a's update, before b's) raises within 60 s
and the next call resumes every agent from the last checkpoint."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.serving import Registered
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from art_adapters.training.sharded import TrainerProcessError
from art_adapters.training.sharded_agents import ShardedPerAgentTrainer
from art_adapters.trajectories import TrajectoryGroup
from test_per_agent_training import groups_of
from test_sharded_faults import Host, _Gateway, _Server, faults  # noqa: F401 (faults: a fixture)

pytestmark = pytest.mark.train
LORA = LoRAConfig(rank=4, alpha=8)
LR = 1e-4  # Adam's first step moves a weight by ~lr whatever its gradient: 1e-6 holds up to ~1e-4 (see
CONFIG = TrainConfig(learning_rate=LR, micro_batch_tokens=64)  # test_sharded_training); several micro-batches
TOLERANCE = 1e-6
FOLDERS = ("", "agents/a", "agents/b")  # the shared adapter's files, then each agent's
ROLE = art.PerAgent(by="role")  # an open list: agents are added as they are met


@pytest.fixture(scope="module")
def single() -> PerAgentTrainer:
    return PerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, seed=3)


@pytest.fixture(scope="module")
def start(single: PerAgentTrainer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step-0 checkpoint holding agents a and b, every adapter already away from the base and from the others
    (lora_B drawn), so each agent's logprobs, gradients and loss differ."""
    single.add_adapters(["a", "b"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in single.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return single.save(tmp_path_factory.mktemp("start"))


@pytest.fixture(scope="module")
def groups(single: PerAgentTrainer, start: Path) -> list[TrajectoryGroup]:
    """Trajectories with a call by a, one by b and one with no agent (the shared adapter's)."""
    return groups_of(single, ["a", "b", None])


@pytest.fixture(scope="module")
def sharded() -> Any:
    trainer = ShardedPerAgentTrainer(tiny_model_path(), LORA, per_agent=ROLE, processes=2, seed=3)
    yield trainer
    trainer.close()


def files(checkpoint: Path, folders: tuple[str, ...] = FOLDERS) -> dict[str, dict[str, torch.Tensor]]:
    """Each adapter's weights and AdamW tensors (`{index}:{name}`), as the checkpoint holds them."""
    out = {}
    for folder in folders:
        where = checkpoint / folder
        state = torch.load(where / "optimizer.pt", weights_only=True)
        moments = {
            f"{index}:{key}": value
            for index, values in state["optimizer"]["state"].items()
            for key, value in values.items()
        }
        out[folder] = {**load_file(str(where / "adapter_model.safetensors")), **moments}
    return out


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_a_sharded_step_trains_every_adapter_as_one_process_does(
    single: PerAgentTrainer, start: Path, groups: list[TrajectoryGroup], sharded: Any, tmp_path: Path
) -> None:
    single.load(start)
    sharded.load(start)  # it held no agent: the processes build their model again with a and b
    assert sharded.agents == ["a", "b"] and sharded.step == 0
    one = single.train_step(groups, CONFIG)
    two = sharded.train_step(groups, CONFIG)
    single.save(tmp_path / "one")
    sharded.save(tmp_path / "two")
    assert sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*")) == sorted(
        p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*")
    )  # the same files, so vLLM serves the sharded trainer's agents as it serves the one-process trainer's
    left, right = files(tmp_path / "one"), files(tmp_path / "two")
    differences = {folder or "shared": worst(left[folder], right[folder]) for folder in FOLDERS}
    print(f"largest |one process - two processes| per adapter (weights and moments): {differences}")
    assert max(differences.values()) < TOLERANCE
    for folder in FOLDERS:  # each adapter moved: a real step, not two no-ops
        weights = load_file(str(start / folder / "adapter_model.safetensors"))
        assert worst(weights, {k: right[folder][k] for k in weights}) > 1e-6
    assert two["trainer_processes"] == 2 and two["adapters_trained"] == one["adapters_trained"] == 3
    assert two["step"] == one["step"] == sharded.step == 1
    for name in ("shared", "a", "b"):
        for key in ("loss", "grad_norm", "trained_tokens", "reward_mean", "trajectories"):
            assert two[f"agent/{name}/{key}"] == pytest.approx(one[f"agent/{name}/{key}"], rel=1e-5, abs=1e-7)
    assert one["agent/a/loss"] != one["agent/b/loss"]  # the adapters really differ


def test_a_step_on_a_leaves_b_and_the_shared_adapter_bit_identical(
    single: PerAgentTrainer, start: Path, groups: list[TrajectoryGroup], sharded: Any, tmp_path: Path
) -> None:
    sharded.load(start)
    sharded.train_step(groups, CONFIG)  # every adapter has AdamW moments now
    sharded.save(tmp_path / "before")
    metrics = sharded.train_step(groups_of(single, ["a"], seed=1), CONFIG)
    sharded.save(tmp_path / "after")
    assert metrics["adapters_trained"] == 1 and metrics["step"] == 2 and "agent/b/loss" not in metrics
    before, after = files(tmp_path / "before"), files(tmp_path / "after")
    for folder in ("agents/b", ""):
        assert before[folder].keys() == after[folder].keys()
        assert all(torch.equal(before[folder][k], after[folder][k]) for k in before[folder]), folder
    assert worst(before["agents/a"], after["agents/a"]) > 0
    ranks = sharded.memory(probe=False)  # each process holds half of every adapter's weights and moments
    for rank in ranks:
        for name, held in rank["adapter_state_bytes"].items():
            print(f"rank {rank['rank']} adapter {name}: {held['held']} of {held['whole']} bytes")
            assert 0.45 * held["whole"] <= held["held"] <= 0.55 * held["whole"], (rank["rank"], name)
    assert sorted(ranks[0]["adapter_state_bytes"]) == ["a", "b", "shared"]


def test_a_checkpoint_resumes_every_agent_in_new_processes(
    single: PerAgentTrainer, start: Path, groups: list[TrajectoryGroup], sharded: Any, tmp_path: Path
) -> None:
    sharded.load(start)
    sharded.train_step(groups, CONFIG)
    middle = sharded.save(tmp_path / "0001")
    assert checkpoints.checkpoint_agents(middle) == ["a", "b"]
    resumed = ShardedPerAgentTrainer(
        tiny_model_path(),
        LORA,
        per_agent=ROLE,
        processes=2,
        seed=3,
        agents=checkpoints.checkpoint_agents(middle),  # as LocalBackend starts it: no rebuild to resume
    )
    try:
        resumed.load(middle)
        assert resumed.agents == ["a", "b"] and resumed.step == 1
        resumed.save(tmp_path / "again")
        saved, again = files(middle), files(tmp_path / "again")
        for folder in FOLDERS:  # weights and AdamW moments, to the bit
            assert all(torch.equal(saved[folder][k], again[folder][k]) for k in saved[folder]), folder
        later = groups_of(single, ["a", "b", None], seed=2)
        assert resumed.train_step(later, CONFIG)["step"] == sharded.train_step(later, CONFIG)["step"] == 2
        resumed.save(tmp_path / "resumed")
    finally:
        resumed.close()
    sharded.save(tmp_path / "continued")
    continued, after_resume = files(tmp_path / "continued"), files(tmp_path / "resumed")
    for folder in FOLDERS:  # the step after a resume is the step without one
        assert all(torch.equal(continued[folder][k], after_resume[folder][k]) for k in continued[folder])


def test_an_agent_first_seen_mid_run_gets_an_adapter_and_the_others_keep_theirs_to_the_bit(
    single: PerAgentTrainer, start: Path, groups: list[TrajectoryGroup], sharded: Any, tmp_path: Path
) -> None:
    """An open list: agent c's first calls make every process build its model again with c's adapter (FSDP2
    shards what a module holds when it wraps it), in the middle of the step; a's, b's and the shared adapter's
    weights and moments come through the rebuild to the bit. SFT is refused before anything is sent."""
    sharded.load(start)
    sharded.train_step(groups, CONFIG)
    sharded.save(tmp_path / "before")
    metrics = sharded.train_step(groups_of(single, ["c"], seed=4), CONFIG)
    assert sharded.agents == ["a", "b", "c"] and sharded.step == 2
    assert metrics["adapters_trained"] == 1 and metrics["agent/c/trained_tokens"] > 0
    sharded.save(tmp_path / "after")
    before, after = files(tmp_path / "before"), files(tmp_path / "after", (*FOLDERS, "agents/c"))
    for folder in FOLDERS:
        assert all(torch.equal(before[folder][k], after[folder][k]) for k in before[folder]), folder
    assert after["agents/c"].keys() == after["agents/a"].keys()
    with pytest.raises(art.UnsupportedPerAgentSetting, match="train_sft"):
        sharded.sft_step([], art.SFTConfig())
    assert sharded.alive


def test_more_agents_than_the_engine_holds_are_refused_before_any_process_starts() -> None:
    with pytest.raises(art.UnsupportedPerAgentSetting, match="adapter 3 .* at most 2"):
        ShardedPerAgentTrainer(
            tiny_model_path(), LORA, per_agent=art.PerAgent(agents=["a", "b"]), processes=2, max_adapters=2
        )


def test_another_host_joins_with_the_same_agents_or_is_refused_by_name() -> None:
    """The command node 0 logs for another host carries the agents held at start; the processes compare them."""
    import shlex

    from art_adapters.training.launcher import WorkerSpec
    from art_adapters.training.rendezvous import facts

    spec = WorkerSpec(base_model=str(tiny_model_path()), lora=LORA, processes=2, nodes=2, adapters=("a", "b"))
    assert '--adapters=["a", "b"]' in shlex.split(spec.join_command(1, "hostA:29400"))
    assert spec.argv("file:/x")[-1] == '--adapters=["a", "b"]'
    assert "--adapters" not in " ".join(WorkerSpec(base_model="m", lora=LORA, processes=2).argv("file:/x"))
    mine = facts(
        str(tiny_model_path()),
        LORA.model_dump_json(),
        engine="peft",
        device="cpu",
        max_seq_len=64,
        processes_per_node=2,
        hsdp=False,
        adapters=["a", "b"],
    )
    assert mine["per-agent adapters"] == ["a", "b"]


async def test_a_rank_killed_mid_step_raises_in_bounded_time_and_every_agent_resumes(
    faults: Path,  # noqa: F811
    single: PerAgentTrainer,
    groups: list[TrajectoryGroup],
    tmp_path: Path,
) -> None:
    """LocalBackend's trainer selection (`trainer_processes=2` with PerAgent) and its replacement of a dead trainer:
    rank 1 is SIGKILLed as it makes b's adapter active, after a's (and the shared one's) update."""
    model = art.TrainableModel(
        name="crew",
        project="p",
        base_model=str(tiny_model_path()),
        lora=LORA,
        adapters=art.PerAgent(by="role", agents=["a", "b"]),
    )
    state = Registered(model, tmp_path / "model", _Server(), _Gateway(), None, 0, asyncio.Lock())  # type: ignore[arg-type]
    host = Host()

    async def step(batch: list[TrajectoryGroup]) -> dict[str, Any]:
        return await host._run_trainer(
            state, lambda t: t.train_step(batch, CONFIG), save=lambda m: "skipped_reason" in m
        )

    first = await host._live_trainer(state)
    assert isinstance(first, ShardedPerAgentTrainer) and first.agents == ["a", "b"]
    assert (await step(groups))["adapters_trained"] == 3 and state.step == 1
    one = checkpoints.checkpoint_dir(state.directory, 1)
    assert checkpoints.checkpoint_agents(one) == ["a", "b"]
    saved = files(one)
    await asyncio.to_thread(faults.write_text, "kill@b 1 train_step")
    started = time.monotonic()
    with pytest.raises(TrainerProcessError, match="rank 1 exited with signal 9"):
        await step(groups_of(single, ["a", "b"], seed=3))
    elapsed = time.monotonic() - started
    print(f"rank 1 killed mid-step: the step raised after {elapsed:.1f} s")
    assert elapsed < 60
    assert state.trainer is None and not first.alive and state.step == 1  # dropped; nothing saved
    assert all(p.poll() is not None for p in first._ranks.processes.values())  # none left behind
    assert checkpoints.list_steps(state.directory) == [0, 1]
    replaced = await host._live_trainer(state)  # a new trainer from checkpoint 0001, every agent in it
    assert isinstance(replaced, ShardedPerAgentTrainer) and replaced is not first
    assert replaced.agents == ["a", "b"] and replaced.step == 1
    await asyncio.to_thread(replaced.save, tmp_path / "replaced")
    again = files(tmp_path / "replaced")
    for folder in FOLDERS:
        assert all(torch.equal(saved[folder][k], again[folder][k]) for k in saved[folder]), folder
    metrics = await step(groups)
    assert state.step == 2 and metrics["adapters_trained"] == 3
    assert checkpoints.list_steps(state.directory) == [0, 1, 2]
    replaced.close()


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_local_backend_serves_each_agent_the_sharded_trainers_weights(
    vllm_server: Any, tmp_path: Path
) -> None:
    """`LocalBackend(trainer_processes=2)` with an open PerAgent list on the real vLLM server: an agent first seen
    at step 1 gets its adapter in the processes mid-step, its checkpoint loads in vLLM, and what vLLM serves as
    that agent is the sharded trainer's weights for it (the swap check, as for one process)."""
    from test_per_agent_vllm import SWAP_TOLERANCE, as_agent

    backend = art.LocalBackend(tmp_path / "art", trainer_processes=2).use_server(vllm_server)
    model = art.TrainableModel(
        name="m",
        project="wide",
        base_model=str(vllm_server.base_model),
        lora=art.LoRAConfig(rank=8, alpha=16),
        adapters=art.PerAgent(by="role"),
    )
    await model.register(backend)
    try:
        trajectories = [await as_agent(model, "scout", k) for k in range(4)]
        for k, trajectory in enumerate(trajectories):
            trajectory.reward = float(k)
        metrics = await model.train([art.TrajectoryGroup(trajectories)], art.TrainConfig(learning_rate=5e-2))
        assert metrics["trainer_processes"] == 2 and metrics["agent/scout/trained_tokens"] > 0
        trainer = await backend.trainer(model)
        assert isinstance(trainer, ShardedPerAgentTrainer) and trainer.agents == ["scout"]
        after = await as_agent(model, "scout", 9)
        assert after.llm_calls[0].served_model == "wide/m.scout@1"
        call = trajectories[0].llm_calls[0]
        ids = list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])
        assert await backend.served_logprob_diff(model, ids, agent="scout") <= SWAP_TOLERANCE
        assert await backend.served_logprob_diff(model, ids) <= SWAP_TOLERANCE  # the shared one too
    finally:
        await backend.close()
