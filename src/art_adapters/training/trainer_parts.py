"""What the trainer does beside its loss: where its state lives (offloaded to CPU while an engine shares its GPU,
freed on close) and the data-parallel plumbing that makes one process and N processes run the same step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .step_guard import token_drop
from .tokenize import TrainSequence

T = TypeVar("T")


class TrainerParts:
    """Mixed into `Trainer`, which provides the attributes below."""

    device: torch.device
    parallel: Any
    model: Any
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    scorer: Any
    pad_id: int
    _measured: list[tuple[list[TrainSequence], bool, torch.Tensor]]

    if TYPE_CHECKING:  # Trainer's

        def _token_logprobs(
            self, rows: list[list[int]], targets: list[list[int]], temperatures: list[float]
        ) -> torch.Tensor: ...

    # --- where the state lives -----------------------------------------------------------------------------

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

    @torch.no_grad()
    def _measured_token_drop(self) -> float:
        """The step guard's measure: this process's micro-batches forwarded again (padding ones too, so sharded
        processes run the same collectives), the largest fall in a trained token's probability, max over processes.
        """
        drop = 0.0
        for batch, padding, before in self._measured:
            after = self._eval_logprobs(batch)
            if not padding:
                drop = max(drop, token_drop(before, after))
        return self._maxed(drop)

    def _has_dropout(self) -> bool:
        """Whether a training forward is noisy (LoRA's or the model's dropout): then the guard measures in eval."""
        return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    @torch.no_grad()
    def _eval_logprobs(self, batch: list[TrainSequence]) -> torch.Tensor:
        """The trained tokens' logprobs with dropout off (eval mode, restored after)."""
        training = self.model.training
        self.model.eval()
        try:
            targets = [[t for t, m in enumerate(s.trained_mask) if m] for s in batch]
            return self._token_logprobs([s.input_ids for s in batch], targets, [s.temperature for s in batch])
        finally:
            self.model.train(training)

    def _maxed(self, value: float) -> float:
        """The value's maximum over every process."""
        if self.parallel is None:
            return value
        from .parallel import maxed

        return maxed(value)

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


def _moved(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if pin:  # pinned host memory: the copy back to the GPU runs at full bus speed
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
    return tensor.to(device)
