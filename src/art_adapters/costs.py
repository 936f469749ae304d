"""Token costs (ART's `art.costs`): prices per million tokens, and the calculator a model carries
(`model.cost_calculator(prompt_tokens, completion_tokens, cost_context) -> {"costs/...": dollars}`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TokenCount = int | None
CostCalculator = Callable[[TokenCount, TokenCount, str], dict[str, float]]


@dataclass(frozen=True)
class ModelPricing:
    """Dollars per million tokens: prompt (prefill), sampled, trained."""

    prefill: float
    sample: float
    train: float


def tokens_to_cost(tokens: float, price_per_million: float) -> float:
    return float(tokens) * price_per_million / 1_000_000


def build_cost_calculator(pricing: ModelPricing) -> CostCalculator:
    """A calculator giving `costs/{context}/prefill` and `costs/{context}/sample` for one call's tokens."""

    def calculate(
        prompt_tokens: TokenCount, completion_tokens: TokenCount, cost_context: str
    ) -> dict[str, float]:
        context = cost_context.strip("/")
        if not context:
            raise ValueError("cost_context must be non-empty (the split, e.g. 'train')")
        return {
            f"costs/{context}/prefill": tokens_to_cost(prompt_tokens or 0, pricing.prefill),
            f"costs/{context}/sample": tokens_to_cost(completion_tokens or 0, pricing.sample),
        }

    return calculate


def compute_train_cost(train_tokens: float, pricing: ModelPricing) -> float:
    return tokens_to_cost(train_tokens, pricing.train)


def no_cost(prompt_tokens: TokenCount, completion_tokens: TokenCount, cost_context: str) -> dict[str, float]:
    """The default calculator: a model with no pricing costs nothing."""
    return {}
