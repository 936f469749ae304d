"""The GRPO/SFT trainer on a LoRA adapter: Unsloth on CUDA, PEFT + transformers otherwise (or on request).

One `train_step` = tokenize the groups, pack micro-batches by a token budget, accumulate the whole step's
gradient, clip it, take one AdamW step. Under torchrun (`parallel`), each process takes its share of the
micro-batches of the same step and FSDP2 sums the gradients (`parallel.py`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..sources import CallSource
from ..trajectories import Trajectory, TrajectoryGroup
from . import adapter_io
from .batching import pack_micro_batches, trajectory_of
from .loss import StepTotals, group_advantages, policy_loss, role_advantages
from .parallel import Parallel
from .quiet import quiet_loading
from .tokenize import (
    TRAIN_ON_KEYS,
    TokenizationError,
    TrainSequence,
    sequences_from_samples,
    sft_samples,
    tokenize_trajectory,
)

log = logging.getLogger(__name__)

Engine = Literal["auto", "unsloth", "peft"]
Metrics = dict[str, Any]


def default_engine() -> Literal["unsloth", "peft"]:
    """Unsloth where its kernels pay off (CUDA); PEFT on CPU, where Unsloth's fallback is plain PyTorch:
    measured on the tiny model it steps no faster (0.131 vs 0.124 s), starts slower (12.2 vs 9.6 s) and
    patches transformers process-wide."""
    return "unsloth" if torch.cuda.is_available() else "peft"


class Trainer:
    """Holds the base model + LoRA adapter, its optimizer, and the step counter."""

    def __init__(
        self,
        base_model: str | Path,
        lora: LoRAConfig | None = None,
        *,
        engine: Engine = "auto",
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int = 2048,
        seed: int = 0,
        gradient_checkpointing: bool = False,
        parallel: Parallel | None = None,
    ) -> None:
        self.base_model = str(base_model)
        self.lora = lora or LoRAConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            cuda_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            dtype = torch.bfloat16 if cuda_bf16 else torch.float32
        self.dtype = dtype
        self.seed = seed
        self.parallel = parallel
        self.step = 0
        self.load_seconds = 0.0
        started = time.perf_counter()
        torch.manual_seed(seed)
        wanted = default_engine() if engine == "auto" else engine
        self.engine: str = wanted
        if wanted == "unsloth":
            try:
                with quiet_loading():
                    self.model, self.tokenizer = self._load_unsloth(max_seq_len, gradient_checkpointing)
            except Exception as error:  # ImportError, or Unsloth refusing this model/device
                log.warning("Unsloth failed (%s: %s); falling back to PEFT", type(error).__name__, error)
                self.engine = "peft"
        if self.engine == "peft":
            torch.manual_seed(seed)
            with quiet_loading():
                self.model, self.tokenizer = self._load_peft(gradient_checkpointing)
        self.load_seconds = time.perf_counter() - started
        self.vocab_size = max(len(self.tokenizer), int(self.model.get_base_model().config.vocab_size))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if parallel is not None:
            from .parallel import shard_decoder_layers

            shard_decoder_layers(self.model, parallel)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # after sharding: its DTensors
        fused = self.device.type == "cuda" and parallel is None
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, fused=fused)

    # --- loading -----------------------------------------------------------------------------------------

    def _load_unsloth(self, max_seq_len: int, gradient_checkpointing: bool) -> tuple[Any, Any]:
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=self.base_model, max_seq_length=max_seq_len, dtype=self.dtype, load_in_4bit=False
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            modules_to_save=list(self.lora.modules_to_save) or None,
            bias="none",
            use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
            random_state=self.seed,
        )
        return model, getattr(tokenizer, "tokenizer", tokenizer)

    def _load_peft(self, gradient_checkpointing: bool) -> tuple[Any, Any]:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.base_model)
        model = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=self.dtype).to(self.device)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        config = LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            modules_to_save=list(self.lora.modules_to_save) or None,
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config), tokenizer

    # --- forward -----------------------------------------------------------------------------------------

    def _token_logprobs(
        self, rows: list[list[int]], targets: list[list[int]], temperatures: list[float]
    ) -> torch.Tensor:
        """Logprobs (logits / T, then log_softmax) of the tokens at positions `targets[b]` of each row."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.tensor(row)
        b_idx = torch.tensor([b for b, ts in enumerate(targets) for _ in ts], dtype=torch.long)
        t_idx = torch.tensor([t for ts in targets for t in ts], dtype=torch.long)
        input_ids = input_ids.to(self.device)
        lm = self.model.get_base_model()
        # Right padding under a causal mask: real tokens never see the pads, so no attention mask is needed.
        hidden = lm.model(input_ids=input_ids).last_hidden_state
        hidden = hidden[b_idx.to(self.device), (t_idx - 1).to(self.device)]
        logits = lm.lm_head(hidden).float()
        temps = torch.tensor(temperatures, dtype=torch.float32, device=self.device)[b_idx.to(self.device)]
        logits = logits / temps[:, None]
        chosen = input_ids[b_idx.to(self.device), t_idx.to(self.device)]
        return logits.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    @torch.no_grad()
    def logprobs_of(self, token_ids: list[int], temperature: float = 1.0, *, start: int = 1) -> list[float]:
        """Logprob of each `token_ids[i]`, i >= start, given `token_ids[:i]`, under the current adapter."""
        self.model.eval()
        positions = list(range(max(start, 1), len(token_ids)))
        if not positions:
            return []
        return self._token_logprobs([list(token_ids)], [positions], [temperature]).tolist()

    # --- one GRPO step -----------------------------------------------------------------------------------

    def train_step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> Metrics:
        """Take one optimizer step on the groups; every group whose rewards are all equal is skipped."""
        started = time.perf_counter()
        metrics = self.compute_gradients(groups, config)
        if "skipped_reason" not in metrics:
            grad_norm = self._clip(config.max_grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = config.learning_rate, config.weight_decay
            self.optimizer.step()
            metrics["grad_norm"] = float(grad_norm)
            metrics["learning_rate"] = config.learning_rate
        else:  # the caller reports it (LocalBackend warns once, naming the model)
            log.info("step %d: %s", self.step + 1, metrics["skipped_reason"])
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self._finish(metrics, started)

    def compute_gradients(self, groups: list[TrajectoryGroup], config: TrainConfig) -> Metrics:
        """The step's full gradient, accumulated over its micro-batches into `.grad` (no optimizer step)."""
        sequences, metrics = self.prepare(groups, config)
        self.optimizer.zero_grad(set_to_none=True)
        if not sequences:
            metrics["skipped_reason"] = skip_reason(groups, metrics)
            return metrics
        trajectories = len({trajectory_of(s) for s in sequences})  # a trajectory may train as several rows
        totals = StepTotals(trained_tokens=sum(s.num_trained for s in sequences), trajectories=trajectories)
        self._seed_step()
        self.model.train()
        sums = {
            "loss": 0.0,
            "tokens": 0.0,
            "clipped": 0.0,
            "ratio": 0.0,
            "kl": 0.0,
            "staleness": 0.0,
            "stale": 0.0,
            "truncated": 0.0,
            "behaviour_weight": 0.0,
        }
        batches = pack_micro_batches(
            [len(s) for s in sequences], config.micro_batch_tokens, [trajectory_of(s) for s in sequences]
        )
        mine, rounds = self._share(batches, [len(s) for s in sequences])
        for batch in mine:
            loss, part = self._micro_batch_loss([sequences[i] for i in batch], config, totals)
            self._backward(loss)
            for key, value in part.items():
                sums[key] += value
        self._finish_backward(rounds - len(mine))
        sums = self._summed(sums)
        tokens = max(sums["tokens"], 1.0)
        metrics.update(
            loss=sums["loss"],
            clip_fraction=sums["clipped"] / tokens,
            mean_ratio=sums["ratio"] / tokens,
            truncated_fraction=sums["truncated"] / tokens,
            mean_behaviour_weight=sums["behaviour_weight"] / tokens,
            sequences=len(sequences),
            micro_batches=len(batches),
            **(
                {"trainer_processes": self.parallel.world, "micro_batches_per_process": rounds}
                if self.parallel
                else {}
            ),
            stale_tokens=int(sums["stale"]),
            token_steps_off_policy=sums["staleness"] / tokens,
        )
        if config.beta > 0:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    def prepare(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> tuple[list[TrainSequence], Metrics]:
        """Attach each trajectory's group advantage, computed over the whole group (a trajectory that trains no
        token, say one that never reached a `train_on` node, still counts in its group's baseline), then tokenize
        every trajectory (groups never mix)."""
        rewards = [t.reward for g in groups for t in g.trajectories]
        metrics: Metrics = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_std": _std(rewards),
            "groups": len(groups),
            "trajectories": len(rewards),
            "skipped_groups": 0,
            "groups_without_samples": 0,
            "skipped_trajectories": 0,
            "trained_tokens": 0,
            "truncated_tokens": 0,
            "ratio_excluded_tokens": 0,
            "ratio_missing_tokens": 0,
            "left_out_tokens": 0,
        }
        excluded_reasons: set[str] = set()
        sequences: list[TrainSequence] = []
        fractions: list[float] = []
        captured: list[float] = []
        unmatched = _Unmatched(config.train_on)
        for g, group in enumerate(groups):
            trajectories = group.trajectories
            advantages = group_advantages(
                [t.reward for t in trajectories], scale_rewards=config.scale_rewards, group_index=g
            )
            by_role = role_advantages(trajectories, config.scale_rewards, g)
            tokenized: list[tuple[int, list[TrainSequence]]] = []
            for i, trajectory in enumerate(trajectories):
                out = tokenize_trajectory(
                    trajectory,
                    self.tokenizer,
                    max_seq_len=config.max_seq_len,
                    vocab_size=self.vocab_size,
                    group_index=g,
                    trajectory_index=i,
                    train_unkept_choices=config.train_unkept_choices,
                    train_on=dict(config.train_on) if config.train_on else None,
                    train_retokenized_text=config.train_retokenized_text,
                )
                unmatched.saw(trajectory, out.sources)
                metrics["truncated_tokens"] += out.truncated_tokens
                metrics["ratio_excluded_tokens"] += out.excluded_tokens
                metrics["ratio_missing_tokens"] += out.missing_tokens
                metrics["left_out_tokens"] += out.left_out_tokens
                excluded_reasons |= out.excluded_reasons
                if out.skipped:
                    metrics["skipped_trajectories"] += 1
                else:
                    trajectory.metrics["sampled_token_fraction"] = out.sampled_token_fraction
                    trajectory.metrics["captured_token_fraction"] = out.captured_token_fraction
                    fractions.append(out.sampled_token_fraction)
                    captured.append(out.captured_token_fraction)
                    tokenized.append((i, out.sequences))
            if not tokenized:
                metrics["groups_without_samples"] += 1
                continue
            if advantages is None and not any(any(values) for values in by_role.values()):
                metrics["skipped_groups"] += 1
                continue
            for i, seqs in tokenized:
                for sequence in seqs:
                    sequence.advantage = advantages[i] if advantages is not None else 0.0
                    sequence.role_advantages = {role: values[i] for role, values in by_role.items()}
                    sequences.append(sequence)
        metrics["sampled_token_fraction"] = min(fractions, default=1.0)
        metrics["captured_token_fraction"] = min(captured, default=1.0)
        if metrics["sampled_token_fraction"] < 1.0 and not config.train_retokenized_text:
            raise TokenizationError(
                f"sampled_token_fraction is {metrics['sampled_token_fraction']:.4f}: some trained tokens were not "
                "sampled by the engine; refusing to train on them (TrainConfig(train_retokenized_text=True) "
                "allows re-tokenized text)"
            )
        metrics["trained_tokens"] = sum(s.num_trained for s in sequences)
        if metrics["ratio_excluded_tokens"]:
            log.warning(
                "%d sampled tokens came from distributions the trainer does not reproduce (%s): trained without an "
                "importance ratio (on-policy weight 1), see training/loss.py",
                metrics["ratio_excluded_tokens"],
                "; ".join(sorted(excluded_reasons)),
            )
        if metrics["ratio_missing_tokens"]:
            log.warning(
                "%d trained tokens have no sampled logprob (the engine returned none for them, e.g. Responses API "
                "tool calls): trained without an importance ratio (on-policy weight 1)",
                metrics["ratio_missing_tokens"],
            )
        unmatched.warn()
        return sequences, metrics

    def _micro_batch_loss(
        self, batch: list[TrainSequence], config: TrainConfig, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rows = [s.input_ids for s in batch]
        targets = [[t for t, m in enumerate(s.trained_mask) if m] for s in batch]
        temps = [s.temperature for s in batch]
        new = self._token_logprobs(rows, targets, temps)
        ref = None
        if config.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._token_logprobs(rows, targets, temps)
        flat = [(b, t) for b, ts in enumerate(targets) for t in ts]
        sampled = torch.tensor([batch[b].sampled_logprobs[t] for b, t in flat], dtype=torch.float32)
        advantages = torch.tensor([batch[b].advantage_at(t) for b, t in flat], dtype=torch.float32)
        units: dict[tuple[int, int], int] = {}  # each trajectory's index inside this micro-batch
        for sequence in batch:
            units.setdefault(trajectory_of(sequence), len(units))
        seq_index = torch.tensor([units[trajectory_of(batch[b])] for b, _ in flat], dtype=torch.long)
        staleness = torch.tensor([batch[b].staleness_at(t, self.step) for b, t in flat], dtype=torch.float32)
        return policy_loss(
            new,
            sampled.to(self.device),
            advantages.to(self.device),
            seq_index.to(self.device),
            config,
            totals,
            ref_logprobs=ref,
            staleness=staleness.to(self.device),
        )

    # --- supervised step ---------------------------------------------------------------------------------

    def sft_step(self, trajectories: list[Trajectory], config: SFTConfig) -> Metrics:
        """One optimizer step of cross-entropy on the assistant turns (token-averaged over the batch)."""
        started = time.perf_counter()
        sequences: list[TrainSequence] = []
        for trajectory in trajectories:
            out = sequences_from_samples(
                sft_samples(trajectory, self.tokenizer), max_seq_len=config.max_seq_len
            )
            sequences += out.sequences
        metrics: Metrics = {"trajectories": len(trajectories), "sequences": len(sequences)}
        total = sum(s.num_trained for s in sequences)
        metrics["trained_tokens"] = total
        if not total:
            metrics["skipped_reason"] = "no assistant tokens"
            return self._finish(metrics, started)
        self._seed_step()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        batches = pack_micro_batches([len(s) for s in sequences], 4096)
        mine, rounds = self._share(batches, [len(s) for s in sequences])
        for batch in mine:
            seqs = [sequences[i] for i in batch]
            targets = [[t for t, m in enumerate(s.trained_mask) if m] for s in seqs]
            logp = self._token_logprobs([s.input_ids for s in seqs], targets, [1.0] * len(seqs))
            loss = -logp.sum() / total
            self._backward(loss)
            loss_sum += float(loss.detach())
        self._finish_backward(rounds - len(mine))
        loss_sum = self._summed({"loss": loss_sum})["loss"]
        grad_norm = self._clip(config.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = config.learning_rate, 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(loss=loss_sum, grad_norm=float(grad_norm), learning_rate=config.learning_rate)
        return self._finish(metrics, started)

    def sft_batches(self, trajectories: list[Trajectory], config: SFTConfig) -> Iterator[list[Trajectory]]:
        return sft_batches(trajectories, config)

    def close(self) -> None:
        """Nothing to release in one process (a ShardedTrainer stops its processes)."""

    # --- state -------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the adapter (PEFT format vLLM loads), the optimizer state and the trainer state (step, rng)."""
        return adapter_io.save_trainer(self, Path(directory))

    def load(self, directory: str | Path) -> None:
        """Resume from `save`: adapter weights, optimizer state, step and rng."""
        adapter_io.load_trainer(self, Path(directory))

    # --- data parallelism (no-ops in one process) -----------------------------------------------------------

    def _share(self, batches: list[list[int]], sizes: list[int]) -> tuple[list[list[int]], int]:
        """This process's micro-batches, and how many every process runs."""
        if self.parallel is None:
            return batches, len(batches)
        from .parallel import my_share

        return my_share(batches, sizes, self.parallel)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's share of the step's loss (scaled by the world size under FSDP2, whose mean
        over processes then gives the sum the step's normalisation needs)."""
        (loss * self.parallel.world if self.parallel is not None else loss).backward()

    def _finish_backward(self, padding: int) -> None:
        """Run `padding` empty micro-batches (FSDP2's collectives need every process at every layer), then sum
        the gradients of the parameters FSDP2 does not manage."""
        if self.parallel is None:
            return
        from .parallel import sum_whole_gradients

        for _ in range(padding):
            empty = self._token_logprobs([[self.pad_id, self.pad_id]], [[1]], [1.0])
            (empty.sum() * 0.0).backward()
        sum_whole_gradients(self.params, self.parallel.world)

    def _summed(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's metric sums over every process."""
        if self.parallel is None:
            return sums
        import torch.distributed as dist

        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return dict(zip(keys, values.tolist(), strict=True))

    def _clip(self, max_norm: float) -> torch.Tensor:
        if self.parallel is None:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        from .parallel import clip_grad_norm

        return clip_grad_norm(self.params, max_norm)

    def _seed_step(self) -> None:
        torch.manual_seed(self.seed * 1_000_003 + self.step)

    def _finish(self, metrics: Metrics, started: float) -> Metrics:
        metrics["step"] = self.step
        metrics["step_seconds"] = time.perf_counter() - started
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics


def sft_batches(trajectories: list[Trajectory], config: SFTConfig) -> Iterator[list[Trajectory]]:
    """The SFT run as batches: `epochs` seeded shuffles, `batch_size` trajectories each."""
    rng = random.Random(config.seed)
    for _ in range(config.epochs):
        order = list(range(len(trajectories)))
        rng.shuffle(order)
        for i in range(0, len(order), int(config.batch_size)):
            yield [trajectories[j] for j in order[i : i + int(config.batch_size)]]


def skip_reason(groups: list[TrajectoryGroup], metrics: Metrics) -> str:
    """Why a step has nothing to train, in words a user can act on."""
    parts = []
    if metrics["skipped_groups"]:
        parts.append(
            f"{metrics['skipped_groups']} group(s) have equal rewards for all their trajectories (no advantage)"
        )
    if metrics["groups_without_samples"]:
        plain = any(
            isinstance(item, dict) and item.get("role") == "assistant"
            for g in groups
            for t in g.trajectories
            for item in t.messages_and_choices
        )
        hint = (
            "their assistant turns are plain message dicts, which carry no sampled tokens: append the Choice "
            "(`completion.choices[0]`) from `model.openai_client()`, or run the agent inside `wrap_rollout` / "
            "`art.trajectory(...)` so its calls are captured"
            if plain
            else "capture the calls through `model.openai_client()`, `wrap_rollout` or `art.trajectory(...)`"
        )
        parts.append(f"{metrics['groups_without_samples']} group(s) have no sampled token ids: {hint}")
    if not groups or not metrics["trajectories"]:
        parts.append("no trajectories were given")
    return "no trainable tokens: " + ("; ".join(parts) or "every sampled token lies beyond max_seq_len")


class _Unmatched:
    """Names in `train_on` and keys of `rewards_by_role` that match no call (a typo trains nothing, silently)."""

    def __init__(self, train_on: dict[str, list[str]] | None) -> None:
        self.train_on = {key: set(names) for key, names in (train_on or {}).items()}
        self.role_keys: set[str] = set()
        self.matched_roles: set[str] = set()

    def saw(self, trajectory: Trajectory, sources: list[CallSource]) -> None:
        for key, names in self.train_on.items():
            by = TRAIN_ON_KEYS[key]
            names -= {name for name in names if any(s.matches(by, {name}) for s in sources)}
        for role in trajectory.rewards_by_role:
            self.role_keys.add(role)
            if any(s.matches("role", {role}) for s in sources):
                self.matched_roles.add(role)

    def warn(self) -> None:
        parts = [f"train_on[{key!r}] {sorted(names)}" for key, names in self.train_on.items() if names]
        roles = sorted(self.role_keys - self.matched_roles)
        if roles:
            parts.append(f"rewards_by_role keys {roles}")
        if parts:
            log.warning(
                "%s match no captured call in this step (a call matches by its role, agent, node name or node "
                "path; see CallSource.role_names)",
                " and ".join(parts),
            )


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
