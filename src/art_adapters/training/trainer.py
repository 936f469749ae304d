"""The GRPO/SFT trainer on a LoRA adapter: Unsloth on CUDA, PEFT + transformers otherwise (or on request).

One `train_step` = tokenize the groups (`prepare.py`), pack micro-batches by a token budget, accumulate the whole
step's gradient, clip it, take one AdamW step. As one of a sharded trainer's processes (`parallel`), it loads its
shards of the model (`fsdp.py`), takes its share of the step's micro-batches, runs padding micro-batches that make
exactly the collectives a real one makes, and syncs gradients on the last one only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
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
from .tokenize import TrainSequence, sequences_from_samples, sft_samples

log = logging.getLogger(__name__)

Engine = Literal["auto", "unsloth", "peft"]
Metrics = dict[str, Any]
T = TypeVar("T")


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
        self.dtype = loading.trainer_dtype(self.device, dtype)
        self.seed = seed
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
        if parallel is not None:
            from .fsdp import build_sharded_peft

            with quiet_loading():
                self.tokenizer = loading.load_tokenizer(self.base_model)
                self.model, self.scorer = build_sharded_peft(
                    self.base_model,
                    loading.peft_config(self.lora),
                    parallel,
                    device=self.device,
                    dtype=self.dtype,
                    seed=seed,
                    checkpointing=gradient_checkpointing,
                )
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
                    )
            except Exception as error:  # ImportError, or Unsloth refusing this model/device
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
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # sharded: its DTensors
        fused = self.device.type == "cuda" and parallel is None
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, fused=fused)

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
        # Right padding under a causal mask: real tokens never see the pads, so no attention mask is needed.
        logits = self.scorer(input_ids, b_idx.to(self.device), (t_idx - 1).to(self.device)).float()
        temps = torch.tensor(temperatures, dtype=torch.float32, device=self.device)[b_idx.to(self.device)]
        logits = logits / temps[:, None]
        chosen = input_ids[b_idx.to(self.device), t_idx.to(self.device)]
        return logits.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

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
        sequences, metrics = self._agreed(lambda: self.prepare(groups, config))
        self.optimizer.zero_grad(set_to_none=True)
        if not sequences:
            metrics["skipped_reason"] = skip_reason(groups, metrics)
            return metrics
        trajectories = len({trajectory_of(s) for s in sequences})  # a trajectory may train as several rows
        totals = StepTotals(trained_tokens=sum(s.num_trained for s in sequences), trajectories=trajectories)
        self._seed_step()
        self.model.train()
        keys = (
            "loss",
            "tokens",
            "clipped",
            "ratio",
            "kl",
            "staleness",
            "stale",
            "truncated",
            "behaviour_weight",
        )
        sums = dict.fromkeys(keys, 0.0)
        batches = pack_micro_batches(
            [len(s) for s in sequences], config.micro_batch_tokens, [trajectory_of(s) for s in sequences]
        )

        def run(batch: list[int] | None) -> torch.Tensor:
            loss, part = self._micro_batch_loss(
                [sequences[i] for i in batch] if batch is not None else [self._padding()], config, totals
            )
            if batch is None:
                return loss * 0.0
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
        )
        if config.beta > 0:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    def prepare(
        self, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> tuple[list[TrainSequence], Metrics]:
        """See `prepare_groups`."""
        return prepare_groups(self.tokenizer, self.vocab_size, groups, config)

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

        def tokenized() -> list[TrainSequence]:
            rows: list[TrainSequence] = []
            for trajectory in trajectories:
                samples = sft_samples(trajectory, self.tokenizer)
                rows += sequences_from_samples(samples, max_seq_len=config.max_seq_len).sequences
            return rows

        sequences = self._agreed(tokenized)
        metrics: Metrics = {"trajectories": len(trajectories), "sequences": len(sequences)}
        total = sum(s.num_trained for s in sequences)
        metrics["trained_tokens"] = total
        if not total:
            metrics["skipped_reason"] = "no assistant tokens"
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
            pack_micro_batches([len(s) for s in sequences], 4096), [len(s) for s in sequences], run
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

    def offload(self) -> None:
        """Move the weights, buffers and optimizer state to CPU (pinned), so an engine sharing this GPU can wake
        into its memory; `reload()` brings them back. Parameters keep their identity (the optimizer's keys). A
        no-op off CUDA, for a sharded trainer's process, or when already offloaded."""
        if self.device.type != "cuda" or self.parallel is not None or getattr(self, "offloaded", False):
            return
        self._move_state(torch.device("cpu"))
        self.offloaded = True

    def reload(self) -> None:
        """Back onto `self.device` after `offload()` (a no-op when not offloaded)."""
        if not getattr(self, "offloaded", False):
            return
        self._move_state(self.device)
        self.offloaded = False

    def close(self) -> None:
        """Release the model and optimizer: references dropped, garbage collected, and on CUDA the allocator's
        cache emptied, so the memory is free before anything else loads (a ShardedTrainer stops its processes).
        The trainer is unusable after it; `step` stays readable."""
        import gc

        for name in ("model", "optimizer", "params", "scorer", "tokenizer"):
            self.__dict__.pop(name, None)
        self.closed = True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _move_state(self, device: torch.device) -> None:
        pin = device.type == "cpu" and torch.cuda.is_available()
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.data = _moved(tensor.data, device, pin)
                if tensor.grad is not None:
                    tensor.grad = None
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = _moved(value, device, pin)

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

    # --- data parallelism (plain loops in one process) -----------------------------------------------------

    def _accumulate(
        self, batches: list[list[int]], sizes: list[int], run: Callable[[list[int] | None], torch.Tensor]
    ) -> int:
        """Backpropagate `run(batch)` for this process's share of `batches`, then `run(None)` (a padding micro-batch:
        the same forwards, backward and collectives as a real one, its loss times zero) until every process has
        run as many; gradients are synced on the last micro-batch only. Returns how many each process ran."""
        if self.parallel is None:
            for batch in batches:
                run(batch).backward()
            return len(batches)
        from .parallel import my_share

        mine, rounds = my_share(batches, sizes, self.parallel)
        for index in range(rounds):
            self.scorer.set_requires_gradient_sync(index == rounds - 1)  # type: ignore[operator]
            run(mine[index] if index < len(mine) else None).backward()
        return rounds

    def _padding(self) -> TrainSequence:
        """A two-token row training its last token with no advantage (a padding micro-batch's one row)."""
        return TrainSequence(
            input_ids=[self.pad_id, self.pad_id],
            trained_mask=[0, 1],
            sampled_logprobs=[0.0, 0.0],
            roles=[(), ()],
            sampled=[True, True],
            captured=[True, True],
            versions=[None, None],
        )

    def _agreed(self, work: Callable[[], T]) -> T:
        """`work()` on every process, which then agree: if it raised on any, every process raises the same
        AgreedError (the group stays in step; see parallel.agree)."""
        if self.parallel is None:
            return work()
        from .parallel import agree

        try:
            result = work()
        except Exception as error:
            agree(self.parallel, error)
            raise
        agree(self.parallel, None)
        return result

    def _summed(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's metric sums over every process."""
        if self.parallel is None:
            return sums
        from .parallel import summed

        return summed(sums)

    def _clip(self, max_norm: float) -> torch.Tensor:
        """torch's clipping in both cases: on DTensor gradients it computes the norm over every process's shards
        (each element once, replicas of HSDP counted once)."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _seed_step(self) -> None:
        torch.manual_seed(self.seed * 1_000_003 + self.step)

    def _finish(self, metrics: Metrics, started: float) -> Metrics:
        metrics["step"] = self.step
        metrics["step_seconds"] = time.perf_counter() - started
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics


def _moved(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if pin:  # pinned host memory: the copy back to the GPU runs at full bus speed
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
    return tensor.to(device)


def _check_ids(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary (0..{vocab_size - 1})")
