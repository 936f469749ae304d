"""The step guard: how far one optimizer update lowered the probability of a token it trained on
(`max_token_drop`), and scaling that update back when it went further than `TrainConfig.max_token_drop` allows.

  D = max over the step's trained tokens of p_before - p_after   (one no-grad forward after optimizer.step())
  if D > delta:  theta <- theta_pre + s * (theta - theta_pre),  s = delta / D, then halved while D > delta
                 (at most 3 tries; the optimizer's moments keep the full update, as after any clipped step).
The update is a line from theta_pre, so a small enough s always fits; three tries bound the forwards a step costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MAX_TRIES = 3


def token_drop(before: torch.Tensor, after: torch.Tensor) -> float:
    """max(p_before - p_after) over tokens (logprobs in, 0.0 for none or when no token fell)."""
    if before.numel() == 0:
        return 0.0
    fall = float((before.exp() - after.exp()).max())
    return math.inf if math.isnan(fall) else max(fall, 0.0)  # a NaN probability after the update: unbounded


class StepGuard:
    """Around one optimizer step: `before_update()` keeps the trainable parameters (only when the guard is on),
    `after_update(measure)` measures the drop with `measure()` (the step's max over every process) and scales back.
    """

    def __init__(self, params: list[torch.Tensor], max_drop: float | None) -> None:
        self.params = params
        self.max_drop = max_drop
        self.kept: list[torch.Tensor] | None = None

    @torch.no_grad()
    def before_update(self) -> None:
        if self.max_drop is not None:
            self.kept = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def after_update(self, measure: Callable[[], float]) -> dict[str, float]:
        drop = measure()
        metrics = {"max_token_drop": drop, "step_scale": 1.0, "guarded": 0.0}
        if self.max_drop is None or self.kept is None or drop <= self.max_drop:
            self.kept = None
            return metrics
        updates = [p.detach() - kept for p, kept in zip(self.params, self.kept, strict=True)]
        scale = (
            self.max_drop / drop if math.isfinite(drop) else 0.0
        )  # a NaN or infinite drop: back to theta_pre
        for _ in range(MAX_TRIES):
            for p, kept, update in zip(self.params, self.kept, updates, strict=True):
                p.copy_(kept + scale * update if scale else kept)  # (0 * NaN is NaN)
            drop = measure()
            if drop <= self.max_drop:
                break
            scale /= 2
        self.kept = None
        metrics.update(max_token_drop=drop, unguarded_token_drop=metrics["max_token_drop"])
        metrics.update(step_scale=scale if drop <= self.max_drop else scale * 2, guarded=1.0)
        return metrics
