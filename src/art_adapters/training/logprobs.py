"""Token logprobs through the output head, a chunk of positions at a time: the head, the temperature, logsumexp and
the gather run on `chunk` positions, and backward recomputes each chunk's logits, so `[T, V]` fp32 never exists."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]


def token_logprobs(
    head: Head,
    hidden: torch.Tensor,
    chosen: torch.Tensor,
    temperatures: torch.Tensor,
    chunk: int | None = None,
) -> torch.Tensor:
    """log_softmax(head(hidden[i]) / temperatures[i])[chosen[i]] for each row i of `hidden` ([N, H]), in fp32.

    `chunk` None or 0: every row at once (the logits of all N rows exist together). Otherwise `chunk` rows at a
    time; under autograd each chunk is checkpointed (only its inputs are kept; backward recomputes its logits), so
    at most one chunk's logits and their gradient exist at any moment."""
    if chunk is not None and chunk < 0:
        raise ValueError(f"logprob chunk tokens must be >= 0 (0 or None: unchunked), not {chunk}")
    rows = hidden.shape[0]
    if not chunk or chunk >= rows:
        return _logprobs(head, hidden, chosen, temperatures)
    parts = []
    for start in range(0, rows, chunk):
        piece = slice(start, start + chunk)
        args = (hidden[piece], chosen[piece], temperatures[piece])
        if torch.is_grad_enabled():
            parts.append(checkpoint(_logprobs, head, *args, use_reentrant=False))
        else:
            parts.append(_logprobs(head, *args))
    return torch.cat(parts)


def _logprobs(
    head: Head, hidden: torch.Tensor, chosen: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden).float() / temperatures[:, None]
    return logits.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
