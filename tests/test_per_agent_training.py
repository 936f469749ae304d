"""Per-agent adapters, trainer side (PEFT on the tiny model, CPU): one agent trains bit-for-bit like the single
adapter; a step on A's calls leaves B's (and the shared) adapter bit-identical; mixed trajectories train each
adapter on its own calls only; checkpoints hold every agent and resume exactly; agent-set changes are told."""

from __future__ import annotations

import logging

import pytest
import torch

import art_adapters as art
from art_adapters.agent_adapters import SHARED, UnsupportedPerAgentSetting
from art_adapters.checkpoints import checkpoint_agents
from art_adapters.config import LoRAConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.per_agent import PerAgentTrainer
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.train

LORA = LoRAConfig(rank=4, alpha=8)
PROMPTS = ["hi", "What is two plus two?", "Tell me a number."]
TARGET = set(range(96))
CONFIG = TrainConfig(learning_rate=1e-2)


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


@torch.no_grad()
def sampled(trainer: Trainer, prompt: list[int], n: int, gen: torch.Generator) -> tuple[list, list]:
    trainer.model.eval()
    ids = torch.tensor([prompt] * n)
    logprobs = []
    for _ in range(4):
        dist = trainer.model(input_ids=ids).logits[:, -1].float().log_softmax(-1)
        token = torch.multinomial(dist.exp(), 1, generator=gen)
        logprobs.append(dist.gather(-1, token))
        ids = torch.cat([ids, token], dim=1)
    return ids[:, len(prompt) :].tolist(), torch.cat(logprobs, dim=1).tolist()


def groups_of(trainer: Trainer, roles: list[str | None], seed: int = 0) -> list[TrajectoryGroup]:
    """One group per prompt, 4 trajectories each; trajectory calls made by `roles` in turn (separate prompts, so
    each call is its own history), sampled from the fresh policy (every adapter's start)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for text in PROMPTS:
        rows: list[list[LLMCall]] = [[] for _ in range(4)]
        for r, role in enumerate(roles):
            messages = [{"role": "user", "content": f"{text} ({r})"}]
            prompt = chat_template_ids(trainer.tokenizer, messages, None)
            completions, logprobs = sampled(trainer, prompt, 4, gen)
            for i, (ids, lps) in enumerate(zip(completions, logprobs, strict=True)):
                rows[i].append(
                    LLMCall(
                        request={"messages": messages, "temperature": 1.0},
                        prompt_token_ids=prompt,
                        completion_token_ids=ids,
                        logprobs=lps,
                        logprobs_mode="processed_logprobs",
                        source=art.CallSource(role=role),
                    )
                )
        trajectories = [
            Trajectory(
                llm_calls=calls,
                reward=sum(t in TARGET for c in calls for t in c.completion_token_ids or []) / 8,
            )
            for calls in rows
        ]
        groups.append(TrajectoryGroup(trajectories))
    return groups


def weights(trainer: Trainer, peft: str) -> dict[str, torch.Tensor]:
    """An adapter's tensors, named without the adapter's name (so two adapters compare key by key)."""
    return {
        n.replace(f".{peft}.", "."): p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if f".{peft}." in n
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_agent_trains_bit_for_bit_like_the_single_adapter(model_path) -> None:
    single = Trainer(model_path, LORA, engine="peft", seed=3)
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"), seed=3)
    groups = groups_of(single, ["solo"])
    assert same(weights(single, "default"), weights(per, "default"))
    for _ in range(2):
        a = single.train_step(groups, CONFIG)
        b = per.train_step(groups, CONFIG)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["step"] == b["step"]
    assert per.agents == ["solo"] and per.step == single.step == 2
    trained = weights(single, "default")
    assert not same(trained, weights(per, "default"))  # the shared adapter did not move...
    assert same(trained, weights(per, "agent_solo"))  # ...the agent's moved exactly as the single one did


def test_a_step_on_a_leaves_b_and_the_shared_adapter_bit_identical(model_path) -> None:
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role", agents=["a", "b"]))
    before = {name: weights(per, name) for name in ("default", "agent_a", "agent_b")}
    metrics = per.train_step(groups_of(per, ["a"]), CONFIG)
    assert metrics["adapters_trained"] == 1 and metrics["step"] == per.step == 1
    assert same(before["agent_b"], weights(per, "agent_b"))
    assert same(before["default"], weights(per, "default"))
    assert not same(before["agent_a"], weights(per, "agent_a"))
    assert per.slots["b"].optimizer.state == {}  # b's optimizer never stepped


def test_mixed_trajectories_train_each_adapter_on_its_own_calls(model_path) -> None:
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"))
    groups = groups_of(per, ["planner", "executor", None])
    metrics = per.train_step(groups, CONFIG)
    assert per.agents == ["executor", "planner"]  # first seen: fresh adapters
    per_call = 4  # sampled tokens per call (all trained: each call is its own history)
    calls = sum(len(g.trajectories) for g in groups)
    for name in ("planner", "executor", "shared"):
        assert metrics[f"agent/{name}/trained_tokens"] == calls * per_call
        assert metrics[f"agent/{name}/trajectories"] == calls
    assert metrics["trained_tokens"] == 3 * calls * per_call
    assert metrics["adapters_trained"] == 3 and metrics["step"] == 1
    norms = [metrics[f"agent/{n}/grad_norm"] for n in ("planner", "executor", "shared")]
    assert metrics["grad_norm"] == pytest.approx(sum(n * n for n in norms) ** 0.5)


def test_checkpoints_hold_every_agent_and_resume_exactly(model_path, tmp_path, caplog) -> None:
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"))
    groups = groups_of(per, ["planner", "executor"])
    per.train_step(groups, CONFIG)
    path = per.save(tmp_path / "0001")
    assert checkpoint_agents(path) == ["executor", "planner"]
    assert (path / "agents/planner/adapter_model.safetensors").is_file()
    resumed = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"))
    resumed.load(path)
    assert resumed.step == 1 and resumed.agents == ["executor", "planner"]
    for peft in ("default", "agent_planner", "agent_executor"):
        assert same(weights(per, peft), weights(resumed, peft))
    a, b = per.train_step(groups, CONFIG), resumed.train_step(groups, CONFIG)
    assert a["loss"] == b["loss"]  # optimizer state resumed too
    assert same(weights(per, "agent_planner"), weights(resumed, "agent_planner"))
    # a different fixed list: what changed is told; executor's adapter is not loaded
    with caplog.at_level(logging.WARNING):
        other = PerAgentTrainer(
            model_path, LORA, per_agent=art.PerAgent(by="role", agents=["planner", "critic"])
        )
        other.load(path)
    assert "not loaded" in caplog.text and "['executor']" in caplog.text and "['critic']" in caplog.text
    assert other.agents == ["critic", "planner"]


def test_more_agents_than_the_engine_holds_is_refused_with_the_numbers(model_path) -> None:
    with pytest.raises(UnsupportedPerAgentSetting, match="adapter 3 .* at most 2"):
        PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(agents=["a", "b"]), max_adapters=2)
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"), max_adapters=2)
    groups = groups_of(per, ["a", "b"])
    before = weights(per, "default")
    with pytest.raises(UnsupportedPerAgentSetting, match="at most 2"):
        per.train_step(groups, CONFIG)
    assert per.step == 0 and same(before, weights(per, "default"))
    with pytest.raises(UnsupportedPerAgentSetting, match="PEFT"):
        PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(), engine="unsloth")
    assert SHARED == ""


def test_a_step_of_several_adapters_reports_the_staleness_of_all_their_tokens(model_path) -> None:
    """With several adapters trained, the step's metrics were the adapters' sums and lost the staleness the
    async pipeline reports (`token_steps_off_policy`): it is the mean over every trained adapter's tokens."""
    per = PerAgentTrainer(model_path, LORA, per_agent=art.PerAgent(by="role"))
    groups = groups_of(per, ["planner", "executor"])
    per.train_step(groups_of(per, ["planner"], seed=1), CONFIG)  # the trainer is at step 1 now
    for call in (c for g in groups for t in g.trajectories for c in t.llm_calls):
        call.policy_version = 0 if call.source.role == "planner" else 1  # planner's tokens: one step behind
    metrics = per.train_step(groups, CONFIG)
    planner, executor = (metrics[f"agent/{a}/trained_tokens"] for a in ("planner", "executor"))
    assert metrics["adapters_trained"] == 2 and planner > 0 and executor > 0
    assert metrics["token_steps_off_policy"] == pytest.approx(planner / (planner + executor))
    assert metrics["stale_tokens"] >= 0 and "max_stale_drop" in metrics
