"""Did training help? The evaluation harness: the user's own rollout over scenarios x attempts x steps, with
bootstrap intervals, unbiased pass@k and paired comparisons between steps (docs/evaluation.md)."""
