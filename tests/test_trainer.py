"""The trainer on the tiny model: exact step accounting, micro-batch invariance, learning, save/resume."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import art_adapters as art
from art_adapters.config import LoRAConfig, SFTConfig, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import chat_template_ids
from art_adapters.training.trainer import Trainer, pack_micro_batches
from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.train

HEAD = LoRAConfig(rank=8, alpha=16, modules_to_save=["lm_head"])
PROMPTS = ["hi", "What is two plus two?", "weather in Paris", "Tell me a number."]
TARGET = set(range(96))  # the toy reward: sampled tokens among the first 96 ids (single bytes)


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def make_trainer(model_path, lora: LoRAConfig = HEAD, **kwargs) -> Trainer:
    return Trainer(model_path, lora, engine="peft", **kwargs)


@torch.no_grad()
def sample(trainer: Trainer, prompt: list[int], n: int, new_tokens: int, temperature: float, gen) -> tuple:
    """n completions of `prompt` from the trainer's policy and their sampled logprobs (post-temperature)."""
    trainer.model.eval()
    ids = torch.tensor([prompt] * n)
    logprobs = []
    for _ in range(new_tokens):
        logits = trainer.model(input_ids=ids).logits[:, -1].float() / temperature
        dist = logits.log_softmax(-1)
        token = torch.multinomial(dist.exp(), 1, generator=gen)
        logprobs.append(dist.gather(-1, token))
        ids = torch.cat([ids, token], dim=1)
    return ids[:, len(prompt) :].tolist(), torch.cat(logprobs, dim=1).tolist()


def rollouts(
    trainer: Trainer, *, group_size: int = 4, new_tokens: int = 6, seed: int = 0, temperature: float = 1.0
) -> list[TrajectoryGroup]:
    """Sample from the trainer's own policy and record the calls as the capture client would."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        prompt = chat_template_ids(trainer.tokenizer, messages, None)
        rows, logprobs = sample(trainer, prompt, group_size, new_tokens, temperature, gen)
        trajectories = []
        for row, lps in zip(rows, logprobs, strict=True):
            call = LLMCall(
                request={"messages": messages, "temperature": temperature},
                prompt_token_ids=prompt,
                completion_token_ids=row,
                logprobs=lps,
                logprobs_mode="processed_logprobs",
            )
            reward = sum(t in TARGET for t in row) / len(row)
            trajectories.append(Trajectory(llm_calls=[call], reward=reward))
        groups.append(TrajectoryGroup(trajectories))
    return groups


@torch.no_grad()
def expected_reward(trainer: Trainer) -> float:
    """Probability mass of the target tokens at the first answer position, averaged over the prompts."""
    trainer.model.eval()
    total = 0.0
    for text in PROMPTS:
        prompt = chat_template_ids(trainer.tokenizer, [{"role": "user", "content": text}], None)
        probs = trainer.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        total += float(probs[sorted(TARGET)].sum())
    return total / len(PROMPTS)


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_gradient_is_invariant_to_the_micro_batch_split(model_path) -> None:
    trainer = make_trainer(model_path)
    groups = rollouts(trainer, new_tokens=5)[:2]
    groups[0].trajectories[0].llm_calls[0].completion_token_ids += [5, 6, 7]  # ragged lengths -> padding
    groups[0].trajectories[0].llm_calls[0].logprobs += [-6.0, -6.0, -6.0]
    results = {}
    for normalization in ("token", "sequence"):
        for budget in (1, 64, 100_000):
            config = TrainConfig(micro_batch_tokens=budget, normalization=normalization, beta=0.05)
            metrics = trainer.compute_gradients(groups, config)
            results[normalization, budget] = (metrics, grads(trainer))
        (m_small, g_small), (m_mid, _), (m_big, g_big) = (results[normalization, b] for b in (1, 64, 100_000))
        assert m_small["micro_batches"] == m_small["sequences"] and m_big["micro_batches"] == 1
        assert 1 < m_mid["micro_batches"] < m_small["micro_batches"]
        assert m_small["trained_tokens"] == m_big["trained_tokens"]
        assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
        for name, grad in g_big.items():
            assert torch.allclose(g_small[name], grad, atol=1e-5, rtol=1e-4), name


def test_only_sampled_tokens_are_trained_and_counted(model_path) -> None:
    trainer = make_trainer(model_path)
    groups = rollouts(trainer, new_tokens=6)
    sampled = sum(len(t.llm_calls[0].completion_token_ids) for g in groups for t in g.trajectories)
    sequences, metrics = trainer.prepare(groups, TrainConfig())
    assert metrics["trained_tokens"] == sampled == sum(s.num_trained for s in sequences)
    for seq, traj in zip(sequences, [t for g in groups for t in g.trajectories], strict=True):
        call = traj.llm_calls[0]
        assert seq.trained_mask == [0] * len(call.prompt_token_ids) + [1] * len(call.completion_token_ids)
    # A limit inside the answers trains none of them: each trajectory is skipped whole and counted, never cut.
    prompt_len = len(groups[0].trajectories[0].llm_calls[0].prompt_token_ids)
    sequences, metrics = trainer.prepare(groups[:1], TrainConfig(max_seq_len=prompt_len + 2))
    assert sequences == [] and metrics["trained_tokens"] == 0
    assert metrics["skipped_too_long"] == metrics["skipped_trajectories"] == len(groups[0].trajectories)
    # The loss sees exactly the trained tokens: the metric's token count equals them, pads included nowhere.
    metrics = trainer.compute_gradients(groups, TrainConfig(micro_batch_tokens=10_000))
    assert metrics["trained_tokens"] == sampled


def test_fresh_adapter_step_has_no_clipping_and_no_kl(model_path) -> None:
    trainer = make_trainer(model_path)
    metrics = trainer.train_step(rollouts(trainer), TrainConfig(beta=0.1, learning_rate=1e-3))
    assert metrics["clip_fraction"] == 0.0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["mean_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["grad_norm"] > 0 and metrics["step"] == 1 and metrics["skipped_groups"] == 0
    # Sampled at T=0.7 (vLLM's processed logprobs): the trainer scores logits / 0.7, so the ratio is still 1.
    cooled = trainer.compute_gradients(rollouts(trainer, seed=2, temperature=0.7), TrainConfig())
    assert cooled["mean_ratio"] == pytest.approx(1.0, abs=1e-6) and cooled["clip_fraction"] == 0.0
    # After a step, the policy moved away from both the sampler and the reference.
    metrics = trainer.compute_gradients(rollouts(trainer, seed=1), TrainConfig(beta=0.1))
    assert metrics["kl"] > 0


def test_groups_stay_intact_however_batched(model_path) -> None:
    trainer = make_trainer(model_path)
    groups = rollouts(trainer)
    groups[1].trajectories[0].reward = float("nan")
    with pytest.raises(ValueError, match="group 1, trajectory 0: reward is nan"):
        trainer.prepare(groups, TrainConfig())
    groups[1].trajectories[0].reward = 0.5
    for trajectory in groups[2].trajectories:
        trajectory.reward = 1.0  # all equal: skipped, counted
    groups[3].trajectories[0].llm_calls = []  # nothing sampled: skipped, counted
    sequences, metrics = trainer.prepare(groups, TrainConfig())
    assert metrics["skipped_groups"] == 1 and metrics["skipped_trajectories"] == 1
    by_group: dict[int, list[float]] = {}
    for seq in sequences:
        by_group.setdefault(seq.group_index, []).append(seq.advantage)
    assert sorted(by_group) == [0, 1, 3] and len(by_group[3]) == 3
    for advantages in by_group.values():
        assert sum(advantages) == pytest.approx(0.0, abs=1e-9)  # each group's own baseline
    for budget in (1, 50, 10_000):
        metrics = trainer.compute_gradients(groups, TrainConfig(micro_batch_tokens=budget))
        assert metrics["sequences"] == len(sequences) and metrics["skipped_groups"] == 1


def test_a_step_where_every_group_is_skipped_completes(model_path) -> None:
    trainer = make_trainer(model_path)
    groups = rollouts(trainer, group_size=2)
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.reward = 1.0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train_step(groups, TrainConfig())
    assert metrics["skipped_groups"] == len(groups) and metrics["trained_tokens"] == 0
    assert "equal rewards" in metrics["skipped_reason"] and metrics["step"] == 1
    assert "sampled token ids" not in metrics["skipped_reason"]
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name])


def test_a_step_without_sampled_tokens_says_so_and_how_to_capture_them(model_path) -> None:
    trainer = make_trainer(model_path)
    groups = [
        art.TrajectoryGroup(
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": str(r)},
                ],
                reward=r,
            )
            for r in (0.0, 1.0)
        )
    ]
    metrics = trainer.train_step(groups, TrainConfig())
    reason = metrics["skipped_reason"]
    assert "1 group(s) have no sampled token ids" in reason and "plain message dicts" in reason
    assert "equal rewards" not in reason and metrics["groups_without_samples"] == 1


def test_toy_reward_rises(model_path) -> None:
    trainer = make_trainer(model_path)
    config = TrainConfig(learning_rate=2e-3, micro_batch_tokens=2048)
    start = expected_reward(trainer)
    curve = []
    for step in range(12):
        metrics = trainer.train_step(rollouts(trainer, group_size=8, seed=step), config)
        curve.append(round(metrics["reward_mean"], 3))
    end = expected_reward(trainer)
    print("expected reward", round(start, 3), "->", round(end, 3), "sampled reward per step", curve)
    assert end > start * 1.5


def test_save_load_resumes_optimizer_and_the_next_step_exactly(model_path, tmp_path) -> None:
    config = TrainConfig(learning_rate=1e-3, weight_decay=0.01)
    first = make_trainer(model_path)
    first.train_step(rollouts(first, seed=0), config)
    first.save(tmp_path / "ckpt")
    next_groups = rollouts(first, seed=1)
    m1 = first.train_step(next_groups, config)

    second = make_trainer(model_path, seed=123)  # different init: everything must come from the checkpoint
    second.load(tmp_path / "ckpt")
    assert second.step == 1
    m2 = second.train_step(next_groups, config)
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"] and m2["step"] == 2
    p1 = dict(first.model.named_parameters())
    for name, p in second.model.named_parameters():
        assert torch.equal(p, p1[name]), name
    s1, s2 = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["vllm_max_lora_rank"] == 128  # lm_head delta: rank = hidden size


def test_saved_adapter_loads_in_peft_with_identical_logprobs(model_path, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(model_path)
    for step in range(2):
        trainer.train_step(rollouts(trainer, seed=step), TrainConfig(learning_rate=5e-3))
    trainer.save(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None and "lm_head" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = chat_template_ids(trainer.tokenizer, [{"role": "user", "content": "hi there"}], None) + [70, 71, 72]
    for temperature in (1.0, 0.7):
        mine = torch.tensor(trainer.logprobs_of(ids, temperature))
        with torch.no_grad():
            logits = served(input_ids=torch.tensor([ids])).logits[0, :-1].float() / temperature
        theirs = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()
    # A bare adapter dir (no optimizer state) loads its weights back into a trainer too.
    (tmp_path / "adapter" / "optimizer.pt").unlink()
    other = make_trainer(model_path, seed=5)
    other.load(tmp_path / "adapter")
    assert torch.allclose(
        torch.tensor(other.logprobs_of(ids)), torch.tensor(trainer.logprobs_of(ids)), atol=1e-5
    )


def test_sft_step_lowers_the_assistant_cross_entropy(model_path) -> None:
    trainer = make_trainer(model_path)
    answer = "The capital of France is Paris."
    trajectories = [
        Trajectory(
            messages_and_choices=[
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": answer},
            ]
        )
    ]
    config = SFTConfig(learning_rate=5e-3)
    losses = [trainer.sft_step(trajectories, config)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] * 0.8
    batches = list(trainer.sft_batches(trajectories * 5, SFTConfig(epochs=2, batch_size=2)))
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]


def test_pack_micro_batches_respects_the_budget() -> None:
    lengths = [5, 30, 12, 12, 7, 100]
    batches = pack_micro_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 40


def test_unsloth_engine_matches_peft(model_path) -> None:
    """Unsloth patches transformers process-wide, so it runs in its own interpreter."""
    script = textwrap.dedent(
        f"""
        import json, time
        t = time.perf_counter()
        from art_adapters.training.trainer import Trainer
        from art_adapters.config import LoRAConfig
        from art_adapters.config import TrainConfig
        from art_adapters.trajectories import LLMCall, Trajectory, TrajectoryGroup
        trainer = Trainer({str(model_path)!r}, LoRAConfig(modules_to_save=["lm_head"]), engine="unsloth")
        lp = trainer.logprobs_of([762, 343, 263, 198, 71, 72, 763])
        calls = [LLMCall(request={{}}, prompt_token_ids=[762, 343, 263], completion_token_ids=c) for c in ([5, 6], [7])]
        group = TrajectoryGroup([Trajectory(llm_calls=[c], reward=r) for c, r in zip(calls, (1.0, 0.0))])
        metrics = trainer.train_step([group], TrainConfig(learning_rate=1e-3))
        print(json.dumps({{"engine": trainer.engine, "lp": lp, "grad_norm": metrics["grad_norm"]}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["engine"] == "unsloth" and 0 < result["grad_norm"] < 1e3
    peft = make_trainer(model_path)
    mine = peft.logprobs_of([762, 343, 263, 198, 71, 72, 763])
    assert result["lp"] == pytest.approx(mine, abs=1e-5)


@pytest.mark.vllm
async def test_vllm_serves_exactly_what_the_trainer_trained(model_path, tmp_path) -> None:
    """The saved adapter served by vLLM samples with the trainer's logprobs (processed_logprobs, T=1 and 0.7)."""
    import httpx

    from art_adapters.inference.config import InferenceConfig
    from art_adapters.inference.vllm_server import VLLMServer
    from art_adapters.training.adapter_io import vllm_unservable_modules

    unservable = vllm_unservable_modules(model_path, ["lm_head"])
    trainer = make_trainer(model_path, HEAD if unservable == [] else LoRAConfig())
    for step in range(3):
        trainer.train_step(rollouts(trainer, seed=step), TrainConfig(learning_rate=1e-2))
    trainer.save(tmp_path / "adapter")
    rank = json.loads((tmp_path / "adapter" / "trainer_state.json").read_text())["vllm_max_lora_rank"]
    config = InferenceConfig(max_lora_rank=max(rank, 16), max_loras=1, kv_cache_gib=1, warmup=False)
    prompt = chat_template_ids(trainer.tokenizer, [{"role": "user", "content": "hi"}], None)
    async with VLLMServer(model_path, config) as server:
        await server.load_lora("trained", tmp_path / "adapter")
        async with httpx.AsyncClient(timeout=120) as client:
            for temperature in (1.0, 0.7):
                body = {"model": "trained", "prompt": prompt, "max_tokens": 12, "temperature": temperature}
                body |= {"logprobs": 0, "return_token_ids": True, "seed": 1, "ignore_eos": True}
                r = await client.post(server.base_url + "/completions", json=body, headers=server.headers)
                choice = r.raise_for_status().json()["choices"][0]
                mine = trainer.logprobs_of(prompt + choice["token_ids"], temperature, start=len(prompt))
                assert mine == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)


def test_rows_of_one_trajectory_share_a_micro_batch() -> None:
    batches = pack_micro_batches([5, 5, 3, 3], budget=10, units=["a", "b", "a", "c"])
    by_row = {row: i for i, batch in enumerate(batches) for row in batch}
    assert by_row[0] == by_row[2]  # trajectory "a"'s two rows together
    assert sorted(row for batch in batches for row in batch) == [0, 1, 2, 3]
