"""The GRPO/SFT trainer on a LoRA adapter: Unsloth on CUDA, PEFT + transformers otherwise (or on request).

One `train_step` = tokenize the groups (`prepare.py`), pack micro-batches by a token budget, accumulate the whole
step's gradient, clip it, take one AdamW step. As one of a sharded trainer's processes (`parallel`), it loads its
shards of the model (`fsdp.py`), takes its share of the step's micro-batches, runs padding micro-batches that make
exactly the collectives a real one makes, and syncs gradients on the last one only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from ..config import LoRAConfig, SFTConfig, TrainConfig
from ..trajectories import Trajectory, TrajectoryGroup
from ..untrusted import parse_step
from . import adapter_io, loading, shard_io
from .batching import pack_micro_batches, trajectory_of
from .fsdp import Scorer
from .loss import StepTotals, policy_loss
from .parallel import Parallel
from .prepare import prepare_groups, sft_batches, skip_reason
from .quiet import quiet_loading
from .shared_prefix import exact_for
from .step_guard import StepGuard
from .tokenize import TrainSequence, sequences_from_samples, sft_samples
from .trainer_parts import TrainerParts
from .versions import check_not_future

log = logging.getLogger(__name__)

Engine = Literal["auto", "unsloth", "peft"]
Metrics = dict[str, Any]
T = TypeVar("T")


def default_engine() -> Literal["unsloth", "peft"]:
    """Unsloth where its kernels pay off (CUDA); PEFT on CPU, where Unsloth's fallback is plain PyTorch:
    measured on the tiny model it steps no faster (0.131 vs 0.124 s), starts slower (12.2 vs 9.6 s) and
    patches transformers process-wide."""
    return "unsloth" if torch.cuda.is_available() else "peft"


class Trainer(TrainerParts):
    """Holds the base model + LoRA adapter, its optimizer, and the step counter.

    What makes it fit: `max_seq_len`, the longest row it is ever handed (Unsloth's `max_seq_length`; a step caps
    `TrainConfig.max_seq_len` by it and skips longer trajectories); `gradient_checkpointing` (Unsloth's on Unsloth,
    torch's non-reentrant one on PEFT); `logprob_chunk_tokens`, the positions whose logits exist at once (None or
    0: all of them); `load_in_4bit`, a 4-bit base (Unsloth on CUDA only, refused elsewhere before loading)."""

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
        logprob_chunk_tokens: int | None = None,
        load_in_4bit: bool = False,
        micro_batch_tokens: int | None = None,
        parallel: Parallel | None = None,
    ) -> None:
        _check_count("max_seq_len", max_seq_len, 2)
        _check_count("micro_batch_tokens (None: no cap)", micro_batch_tokens or 1, 1)
        _check_count("logprob_chunk_tokens (0 or None: unchunked)", logprob_chunk_tokens or 0, 0)
        self.base_model = str(base_model)
        self.lora = lora or LoRAConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = loading.trainer_dtype(self.device, dtype)
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.gradient_checkpointing = gradient_checkpointing
        self.logprob_chunk_tokens = logprob_chunk_tokens or None
        # the most tokens one micro-batch may hold (the GPU plan's budget): a step asking more is capped at it
        self.micro_batch_tokens = micro_batch_tokens
        self.load_in_4bit = load_in_4bit
        self.parallel = parallel
        self.step = 0
        self.load_seconds = 0.0
        started = time.perf_counter()
        torch.manual_seed(seed)
        wanted = default_engine() if engine == "auto" else engine
        if parallel is not None and wanted == "unsloth":  # Unsloth's own FSDP2 route has not run on GPUs here
            log.warning("the sharded trainer runs PEFT + transformers under FSDP2, not Unsloth")
            wanted = "peft"
        self.engine: str = wanted
        if load_in_4bit and (wanted != "unsloth" or self.device.type != "cuda"):
            raise ValueError(
                "load_in_4bit needs Unsloth on a CUDA device (bitsandbytes' 4-bit kernels); this trainer would run "
                f"{'the sharded PEFT trainer' if parallel is not None else wanted} on {self.device.type}: "
                "load the base in its own dtype (load_in_4bit=False)"
            )
        if parallel is not None:
            with quiet_loading():
                self.tokenizer = loading.load_tokenizer(self.base_model)
            self._build_sharded(self._sharded_adapters())
        elif wanted == "unsloth":
            try:
                with quiet_loading(unsloth=True):
                    self.model, self.tokenizer = loading.load_unsloth(
                        self.base_model,
                        self.lora,
                        self.dtype,
                        max_seq_len,
                        gradient_checkpointing,
                        seed,
                        device=self.device,
                        load_in_4bit=load_in_4bit,
                    )
            except Exception as error:  # ImportError, or Unsloth refusing this model/device
                if load_in_4bit:  # PEFT cannot honour it: no silent bf16 fallback
                    raise RuntimeError(f"Unsloth could not load the 4-bit base: {error}") from error
                log.warning("Unsloth failed (%s: %s); falling back to PEFT", type(error).__name__, error)
                self.engine = "peft"
        if self.engine == "peft" and parallel is None:
            torch.manual_seed(seed)
            with quiet_loading():
                self.model, self.tokenizer = loading.load_peft(
                    self.base_model, self.lora, self.dtype, self.device, gradient_checkpointing
                )
        self.load_seconds = time.perf_counter() - started
        self.vocab_size = max(len(self.tokenizer), int(self.model.get_base_model().config.vocab_size))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if parallel is None:
            self.scorer = Scorer(self.model.get_base_model())
            # Unsloth's patched forward and FSDP2's per-layer hooks are not run twice in one forward here
            self.scorer.share_prefix = (
                self.engine == "peft"
                and not gradient_checkpointing
                and exact_for(self.model.get_base_model().config, self.lora.dropout)
            )
        self.scorer.chunk_tokens = self.logprob_chunk_tokens
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # sharded: its DTensors
        fused = self.device.type == "cuda" and parallel is None
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, fused=fused)
        # the step guard's record of the step's forwards: (rows, padding?, pre-step logprobs)
        self._measured: list[tuple[list[TrainSequence], bool, torch.Tensor]] = []
        self._last_logprobs = torch.empty(0)

    def _build_sharded(self, adapters: list[str]) -> None:
        """This process's shards of the PEFT model (`fsdp.build_sharded_peft`), with `adapters` beside PEFT's
        "default" (per-agent trainers: FSDP2 shards what the model holds when it wraps it)."""
        from .fsdp import build_sharded_peft

        assert self.parallel is not None
        with quiet_loading():
            self.model, self.scorer = build_sharded_peft(
                self.base_model,
                loading.peft_config(self.lora),
                self.parallel,
                device=self.device,
                dtype=self.dtype,
                seed=self.seed,
                checkpointing=self.gradient_checkpointing,
                adapters=adapters,
            )
        self.scorer.chunk_tokens = self.logprob_chunk_tokens

    def _sharded_adapters(self) -> list[str]:
        """PEFT adapters a sharded model is built with besides "default" (a per-agent trainer's agents)."""
        return []

    # --- forward -----------------------------------------------------------------------------------------

    def _token_logprobs(
        self, rows: list[list[int]], targets: list[list[int]], temperatures: list[float]
    ) -> torch.Tensor:
        """Logprobs (logits / T, then log_softmax) of the tokens at positions `targets[b]` of each row."""
        width = max(len(r) for r in rows)
        if width > self.max_seq_len:  # Unsloth would cut the row and the positions would index past it
            raise ValueError(
                f"a row of {width} tokens is longer than the trainer's max_seq_len={self.max_seq_len}"
            )
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.tensor(row)
        b_idx = torch.tensor([b for b, ts in enumerate(targets) for _ in ts], dtype=torch.long)
        t_idx = torch.tensor([t for ts in targets for t in ts], dtype=torch.long)
        input_ids, b_idx, t_idx = input_ids.to(self.device), b_idx.to(self.device), t_idx.to(self.device)
        temps = torch.tensor(temperatures, dtype=torch.float32, device=self.device)[b_idx]
        # Right padding under a causal mask: real tokens never see the pads, so no attention mask is needed.
        return self.scorer(input_ids, b_idx, t_idx - 1, input_ids[b_idx, t_idx], temps)

    @torch.no_grad()
    def logprobs_of(self, token_ids: list[int], temperature: float = 1.0, *, start: int = 1) -> list[float]:
        """Logprob of each `token_ids[i]`, i >= start, given `token_ids[:i]`, under the current adapter."""
        self.model.eval()
        positions = list(range(max(start, 1), len(token_ids)))
        self._agreed(lambda: _check_ids(token_ids, self.vocab_size))
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
            guard = StepGuard(self.params, config.max_token_drop)
            guard.before_update()
            measure = config.max_token_drop is not None or config.measure_token_drop
            if measure and self._has_dropout():  # the training forward's logprobs carry dropout's noise
                self._measured = [(b, pad, self._eval_logprobs(b)) for b, pad, _ in self._measured]
            self.optimizer.step()
            if measure:
                metrics.update(guard.after_update(self._measured_token_drop))
            metrics["grad_norm"] = float(grad_norm)
            metrics["learning_rate"] = config.learning_rate
        else:  # the caller reports it (LocalBackend warns once, naming the model)
            log.info("step %d: %s", self.step + 1, metrics["skipped_reason"])
        self.optimizer.zero_grad(set_to_none=True)
        self._measured = []
        self.step += 1
        return self._finish(metrics, started)

    def compute_gradients(self, groups: list[TrajectoryGroup], config: TrainConfig) -> Metrics:
        """The step's full gradient, accumulated over its micro-batches into `.grad` (no optimizer step)."""
        sequences, metrics = self._agreed(lambda: self.prepare(groups, config))
        self.optimizer.zero_grad(set_to_none=True)
        if not sequences:
            metrics["skipped_reason"] = skip_reason(groups, metrics)
            return metrics
        trajectories = len({trajectory_of(s) for s in sequences})  # a trajectory may train as several rows
        totals = StepTotals(trained_tokens=sum(s.num_trained for s in sequences), trajectories=trajectories)
        self._seed_step()
        self.model.train()
        keys = "loss tokens clipped ratio kl staleness stale truncated behaviour_weight".split()
        sums = dict.fromkeys(keys, 0.0)
        stale_drop = 0.0
        measure = config.max_token_drop is not None or config.measure_token_drop
        self._measured = []
        batches = pack_micro_batches(
            [len(s) for s in sequences],
            self.micro_batch_budget(config.micro_batch_tokens),
            [trajectory_of(s) for s in sequences],
        )

        def run(batch: list[int] | None) -> torch.Tensor:
            nonlocal stale_drop
            rows = [sequences[i] for i in batch] if batch is not None else [self._padding()]
            loss, part = self._micro_batch_loss(rows, config, totals)
            if measure:
                self._measured.append((rows, batch is None, self._last_logprobs))
            if batch is None:
                return loss * 0.0
            stale_drop = max(stale_drop, part.pop("stale_drop_max", 0.0))
            for key, value in part.items():
                sums[key] += value
            return loss

        rounds = self._accumulate(batches, [len(s) for s in sequences], run)
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
            max_stale_drop=self._maxed(stale_drop),
        )
        if config.beta > 0:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    def prepare(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> tuple[list[TrainSequence], Metrics]:
        """See `prepare_groups`; the step's limit is `seq_limit(config.max_seq_len)`; a step whose tokens claim a
        version newer than this trainer's is refused."""
        limit = self.seq_limit(config.max_seq_len)
        sequences, metrics = prepare_groups(
            self.tokenizer, self.vocab_size, groups, config, max_seq_len=limit
        )
        check_not_future(groups, (v for s in sequences for v in s.versions), self.step)
        return sequences, metrics

    def micro_batch_budget(self, asked: int) -> int:
        """A micro-batch's token budget: what the config asks, never above the trainer's `micro_batch_tokens` (what
        its memory was planned for); a sequence longer than the budget still trains, alone in its micro-batch."""
        return asked if self.micro_batch_tokens is None else min(asked, self.micro_batch_tokens)

    def seq_limit(self, asked: int | None) -> int:
        """A step's longest sequence: what the config asks (None: no limit of its own), never above the trainer's
        `max_seq_len` (what Unsloth was loaded for)."""
        return self.max_seq_len if asked is None else min(asked, self.max_seq_len)

    def _micro_batch_loss(
        self, batch: list[TrainSequence], config: TrainConfig, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rows = [s.input_ids for s in batch]
        targets = [[t for t, m in enumerate(s.trained_mask) if m] for s in batch]
        temps = [s.temperature for s in batch]
        ref = None
        if (
            config.beta > 0
        ):  # the reference policy first: its no-grad forward never sits inside a pending backward
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._token_logprobs(rows, targets, temps)
        new = self._token_logprobs(rows, targets, temps)
        self._last_logprobs = new.detach()
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

        limit = self.seq_limit(config.max_seq_len)

        def tokenized() -> tuple[list[TrainSequence], list[str]]:
            rows: list[TrainSequence] = []
            too_long: list[str] = []
            for i, trajectory in enumerate(trajectories):
                out = sequences_from_samples(sft_samples(trajectory, self.tokenizer), max_seq_len=limit)
                rows += out.sequences
                too_long += [f"trajectory {i} ({out.too_long} tokens)"] if out.too_long else []
            return rows, too_long

        sequences, too_long = self._agreed(tokenized)
        metrics: Metrics = {"trajectories": len(trajectories), "sequences": len(sequences)}
        metrics["skipped_too_long"] = len(too_long)
        if too_long:
            log.warning("SFT: longer than max_seq_len=%d, skipped: %s", limit, ", ".join(too_long))
        total = sum(s.num_trained for s in sequences)
        metrics["trained_tokens"] = total
        if not total:
            metrics["skipped_reason"] = (
                f"no assistant tokens{f' within max_seq_len={limit}' if too_long else ''}"
            )
            return self._finish(metrics, started)
        self._seed_step()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses = {"loss": 0.0}

        def run(batch: list[int] | None) -> torch.Tensor:
            seqs = [sequences[i] for i in batch] if batch is not None else [self._padding()]
            targets = [[t for t, m in enumerate(s.trained_mask) if m] for s in seqs]
            logp = self._token_logprobs([s.input_ids for s in seqs], targets, [1.0] * len(seqs))
            loss = -logp.sum() / total
            if batch is None:
                return loss * 0.0
            losses["loss"] += float(loss.detach())
            return loss

        self._accumulate(
            pack_micro_batches([len(s) for s in sequences], self.micro_batch_budget(4096)),
            [len(s) for s in sequences],
            run,
        )
        loss_sum = self._summed(losses)["loss"]
        grad_norm = self._clip(config.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = config.learning_rate, 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(loss=loss_sum, grad_norm=float(grad_norm), learning_rate=config.learning_rate)
        return self._finish(metrics, started)

    def sft_batches(self, trajectories: list[Trajectory], config: SFTConfig) -> Iterator[list[Trajectory]]:
        return sft_batches(trajectories, config)

    # --- state -------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the adapter (PEFT format vLLM loads), the optimizer state and the trainer state (step, rng): the
        same files whether the trainer is one process or sharded (gathered by every process; the leader writes)."""
        if self.parallel is not None:
            return shard_io.save_sharded(self, Path(directory))
        return adapter_io.save_trainer(self, Path(directory))

    def load(self, directory: str | Path) -> None:
        """Resume from `save`: adapter weights, optimizer state, step and rng (a checkpoint folder's name is its
        step)."""
        if self.parallel is not None:
            shard_io.load_sharded(self, Path(directory))
            step = parse_step(Path(directory).name)
            self.step = step if step is not None else self.step
            return
        adapter_io.load_trainer(self, Path(directory))

    def _seed_step(self) -> None:
        torch.manual_seed(self.seed * 1_000_003 + self.step)

    def _finish(self, metrics: Metrics, started: float) -> Metrics:
        metrics["step"] = self.step
        metrics["step_seconds"] = time.perf_counter() - started
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")


def _check_ids(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary (0..{vocab_size - 1})")
