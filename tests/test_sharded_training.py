"""Data-parallel, sharded training (FSDP2, gloo on this CPU): one step on 2 processes and on 1, from the same
checkpoint on the same batch, gives the same adapter (fp32, within 1e-6) and the same metrics, for each loss, KL with
an uneven number of micro-batches (a padding micro-batch runs the reference forward too), `train_on`, per-role
rewards, a trained `lm_head`, SFT, and a resume. And the memory it is for: during a step each of 2 processes holds
about half the frozen weights, and its peak RSS is below one process's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from art_adapters.config import LoRAConfig, SFTConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.sharded import ShardedTrainer, TrainerProcessError
from art_adapters.training.tokenize import TokenizationError
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import Trajectory, TrajectoryGroup
from test_train_on import two_node_trajectory
from test_trainer import rollouts

pytestmark = pytest.mark.train
HEAD = LoRAConfig(rank=8, alpha=16, modules_to_save=["lm_head"])
# Adam's first step moves each element by about lr * sign(g): an element whose gradient is ~0 by cancellation moves by
# a fraction of lr that depends on the order of summation, so "equal within 1e-6" holds for lr up to ~1e-4.
LR = 1e-4
COMPARED = (
    "loss",
    "clip_fraction",
    "mean_ratio",
    "trained_tokens",
    "sampled_token_fraction",
    "left_out_tokens",
)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    trainer = Trainer(tiny_model_path(), HEAD, engine="peft")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an adapter that already differs from the base, so KL to the reference is not zero
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    start = tmp_path_factory.mktemp("start")
    trainer.save(start)
    return trainer, start


@pytest.fixture(scope="module")
def sharded() -> Any:
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, engine="peft")
    yield trainer
    trainer.close()


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def assert_same_adapter(a: Path, b: Path, tolerance: float = 1e-6) -> float:
    left, right = adapter(a), adapter(b)
    assert left.keys() == right.keys()
    worst = max(float((left[k] - right[k]).abs().max()) for k in left)
    assert worst < tolerance, worst
    return worst


def groups_with_roles(trainer: Trainer) -> list[TrajectoryGroup]:
    trajectories = []
    for k, (reward, planner) in enumerate([(1.0, 0.2), (0.0, 0.9), (0.5, 0.4), (0.25, 0.1)]):
        trajectory = two_node_trajectory(trainer, k, reward, lp_shift=0.3)
        trajectory.rewards_by_role = {"planner": planner}
        trajectories.append(trajectory)
    return [TrajectoryGroup(trajectories)]


CASES: dict[str, tuple[str, TrainConfig]] = {
    "grpo, several micro-batches": ("rollouts", TrainConfig(learning_rate=LR, micro_batch_tokens=64)),
    "gspo": ("rollouts", TrainConfig(learning_rate=LR, loss="gspo", micro_batch_tokens=96)),
    "cispo": ("rollouts", TrainConfig(learning_rate=LR, loss="cispo")),
    "kl, uneven micro-batches": ("rollouts", TrainConfig(learning_rate=LR, beta=0.1, micro_batch_tokens=150)),
    "step guard, uneven micro-batches": (
        "rollouts",
        TrainConfig(learning_rate=2e-3, max_token_drop=0.005, micro_batch_tokens=150),
    ),
    "train_on + per-role rewards": (
        "roles",
        TrainConfig(learning_rate=LR, train_on={"nodes": ["executor"]}, micro_batch_tokens=48),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_train_what_one_does(
    case: str, single: tuple[Trainer, Path], sharded: ShardedTrainer, tmp_path: Path
) -> None:
    trainer, start = single
    kind, config = CASES[case]
    groups = rollouts(trainer, seed=3) if kind == "rollouts" else groups_with_roles(trainer)
    trainer.load(start)
    sharded.load(start)
    one = trainer.train_step(groups, config)
    two = sharded.train_step(groups, config)
    trainer.save(tmp_path / "one")
    sharded.save(tmp_path / "two")
    # Adam moves each weight by about lr whatever its gradient's size, so float noise in a gradient near zero moves
    # a weight by up to lr: the tolerance grows with the learning rate (1e-6 at LR)
    assert_same_adapter(tmp_path / "one", tmp_path / "two", 1e-6 * max(1.0, config.learning_rate / LR))
    for key in COMPARED:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert two["step"] == one["step"] == sharded.step == 1
    assert [t.metrics["sampled_token_fraction"] for g in groups for t in g] == [1.0] * sum(
        len(g) for g in groups
    )
    assert two["trainer_processes"] == 2 and "trainer_processes" not in one
    if config.micro_batch_tokens < 100:  # several micro-batches: each process ran its share, not all of them
        assert two["micro_batches_per_process"] < two["micro_batches"] == one["micro_batches"]
    if config.max_token_drop is not None:  # the guard bound on both: the same drop, scale and weights
        assert one["guarded"] == two["guarded"] == 1.0
        for key in ("max_token_drop", "unguarded_token_drop", "step_scale"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    if kind == "roles":
        assert one["left_out_tokens"] > 0  # the planner's tokens were left out on both
    if config.beta > 0:
        assert (
            two["micro_batches"] % 2 == 1
        )  # one process ran a padding micro-batch, reference forward included
        assert two["kl"] == pytest.approx(one["kl"], rel=1e-5, abs=1e-9) and one["kl"] > 0


def test_resume_sft_and_a_refused_batch_match_too(
    single: tuple[Trainer, Path], sharded: ShardedTrainer, tmp_path: Path
) -> None:
    """Two steps with a save and reload in between (the optimizer's moments survive sharding), an SFT step, the
    trainer's logprobs, and a batch refused by tokenization: the same error, and the processes still serve."""
    trainer, start = single
    config = TrainConfig(learning_rate=LR, micro_batch_tokens=64)
    trainer.load(start)
    sharded.load(start)
    first = rollouts(trainer, seed=5)
    trainer.train_step(first, config)
    sharded.train_step(first, config)
    sharded.save(tmp_path / "mid")
    sharded.load(tmp_path / "mid")
    second = rollouts(trainer, seed=6)
    trainer.train_step(second, config)
    sharded.train_step(second, config)
    sft = [
        Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        )
    ] * 3
    assert sharded.sft_step(sft, SFTConfig(learning_rate=LR))["loss"] == pytest.approx(
        trainer.sft_step(sft, SFTConfig(learning_rate=LR))["loss"], rel=1e-5
    )
    trainer.save(tmp_path / "one")
    sharded.save(tmp_path / "two")
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    ids = [5, 6, 7, 8, 9]
    assert sharded.logprobs_of(ids) == pytest.approx(trainer.logprobs_of(ids), abs=1e-6)

    bad = rollouts(trainer, seed=7)
    bad[0].trajectories[0].llm_calls[0].completion_token_ids[0] = 10**6  # not a token of this vocabulary
    with pytest.raises(TokenizationError, match="outside the tokenizer's vocabulary"):
        sharded.train_step(bad, config)
    with pytest.raises(TrainerProcessError, match=r"token ids \[999999\] are outside the model's vocabulary"):
        sharded.logprobs_of([5, 999999])
    assert sharded.train_step(rollouts(trainer, seed=7), config)["trained_tokens"] > 0  # still serving


def test_two_processes_with_chunked_logprobs_train_what_one_unchunked_does(
    single: tuple[Trainer, Path], tmp_path: Path
) -> None:
    """The head (trained here) under FSDP2 runs chunk by chunk in forward and again in backward's recomputation:
    the same adapter as one process computing every position's logits at once, KL's reference forward included."""
    trainer, start = single
    config = TrainConfig(learning_rate=LR, beta=0.1, micro_batch_tokens=64)
    groups = rollouts(trainer, seed=3)
    chunked = ShardedTrainer(tiny_model_path(), HEAD, processes=2, engine="peft", logprob_chunk_tokens=5)
    try:
        trainer.load(start)
        chunked.load(start)
        one = trainer.train_step(groups, config)
        two = chunked.train_step(groups, config)
        trainer.save(tmp_path / "one")
        chunked.save(tmp_path / "two")
    finally:
        chunked.close()
    assert trainer.logprob_chunk_tokens is None
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["kl"] == pytest.approx(one["kl"], rel=1e-5, abs=1e-9)


@pytest.mark.vllm
async def test_local_backend_trains_on_two_processes_with_one_setting(
    vllm_server: Any, tmp_path: Path
) -> None:
    """`LocalBackend(trainer_processes=2)`: the same calls, a step trained by two processes, its checkpoint the
    usual single adapter folder, hot-loaded: vLLM's logprobs under the new step equal the trainer's. A process
    killed between steps: the next step runs on a new trainer resumed from the last checkpoint."""
    import signal

    import art_adapters as art
    from fixtures_vllm import sampled_group

    backend = art.LocalBackend(tmp_path, trainer_processes=2).use_server(vllm_server)
    model = art.TrainableModel(
        name="wide",
        project="sharded",
        base_model=str(vllm_server.base_model),
        lora=LoRAConfig(rank=8, alpha=16),
    )
    await model.register(backend)
    try:
        groups = [await sampled_group(model, [1.0, 0.0, 0.5, 0.0])]
        result = await backend.train(model, groups, learning_rate=1e-3)
        assert result.step == 1 and result.metrics["trainer_processes"] == 2
        assert result.metrics["trained_tokens"] > 0
        folder = backend.model_dir(model) / "checkpoints" / "0001"
        assert sorted(p.name for p in folder.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "optimizer.pt",
            "trainer_state.json",
        ]
        trainer = await backend.trainer(model)
        assert isinstance(trainer, ShardedTrainer) and trainer.engine == "peft+fsdp2x2"
        ids = [1, 2, 3, 72, 101, 108, 108, 111]
        assert (
            await backend.served_logprob_diff(model, ids, 1) <= 1e-4
        )  # as for one process (test_train_loop)
        trainer._ranks.processes[1].send_signal(signal.SIGKILL)
        trainer._ranks.processes[1].wait(timeout=10)
        result = await backend.train(model, groups, learning_rate=1e-3)
        replaced = await backend.trainer(model)
        assert result.step == 2 and replaced is not trainer and replaced.alive and not trainer.alive
        assert await backend.served_logprob_diff(model, ids, 2) <= 1e-4
    finally:
        await backend.close()
    assert all(p.poll() is not None for p in replaced._ranks.processes.values())  # close() stopped them


# --- the memory proof ---------------------------------------------------------------------------------------------

DEEP = {  # 32 layers of ~1.6M parameters (~51M, 205 MB fp32): one layer is 3 % of the weights
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "layer_types": ["full_attention"] * 32,
    "max_window_layers": 32,
}


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny byte model's tokenizer on a deeper, wider model (random weights): deep enough that one gathered
    layer is a small share of the weights, large enough that the weights show in a process's RSS."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = tiny_model_path()
    out = tmp_path_factory.mktemp("deep")
    for path in tiny.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out / path.name)
    config = AutoConfig.from_pretrained(tiny, **DEEP)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 32
    return out


def fabricated_groups() -> list[TrajectoryGroup]:
    """Three short trajectories of one group: three micro-batches at a 16-token budget (an uneven number for 2
    processes), little compute on the deep model."""
    from art_adapters.calls import LLMCall

    trajectories = []
    for k in range(3):
        call = LLMCall(
            request={"messages": [{"role": "user", "content": "q"}], "temperature": 1.0},
            prompt_token_ids=[100 + k, 101, 102, 103, 104, 105],
            completion_token_ids=[40 + (k * 7 + i) % 50 for i in range(6)],
            logprobs=[-6.0 - 0.1 * i for i in range(6)],
            logprobs_mode="processed_logprobs",
        )
        trajectories.append(Trajectory(llm_calls=[call], reward=k / 2))
    return [TrajectoryGroup(trajectories)]


def test_two_processes_hold_half_the_weights_during_a_step(deep_model: Path) -> None:
    """Each process's frozen weights during a step (sampled at every layer's forward, backward's recomputation
    included), and its peak RSS, at 2 processes against 1, on a step of an uneven number of micro-batches."""
    config = TrainConfig(learning_rate=LR, micro_batch_tokens=16)
    groups = fabricated_groups()
    seen: dict[int, list[dict[str, Any]]] = {}
    for processes in (1, 2):
        trainer = ShardedTrainer(deep_model, LoRAConfig(rank=8, alpha=16), processes=processes)
        try:
            trainer.memory(probe=True)
            metrics = trainer.train_step(groups, config)
            seen[processes] = trainer.memory(probe=False)
        finally:
            trainer.close()
        assert metrics["micro_batches"] == 3 and metrics["trained_tokens"] == 18
    whole = seen[1][0]["frozen_weight_bytes"]
    one_peak = seen[1][0]["resident_weight_bytes_peak"]
    two_peak = max(r["resident_weight_bytes_peak"] for r in seen[2])
    rss_one = seen[1][0]["peak_rss_bytes"]
    rss_two = max(r["peak_rss_bytes"] for r in seen[2])
    print(
        f"frozen weights {whole / 2**20:.1f} MiB; held during a step: 1 process {one_peak / 2**20:.1f} MiB, "
        f"2 processes {two_peak / 2**20:.1f} MiB each ({two_peak / one_peak:.3f}x; {two_peak / whole:.3f}x of the "
        f"whole); peak RSS 1 process {rss_one / 2**20:.0f} MiB, 2 processes "
        f"{[round(r['peak_rss_bytes'] / 2**20) for r in seen[2]]} MiB"
    )
    assert two_peak <= 0.55 * one_peak and two_peak <= 0.55 * whole
    assert rss_two < rss_one
