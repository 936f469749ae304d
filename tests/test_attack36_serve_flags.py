"""Attack on `art-adapters serve`'s engine flags: nonsense (TP 0, utilization 1.5 or NaN, max-seq-len -1, replicas
0) is refused before anything loads, and the refusal names the flag (it said only "Input should be greater than 0",
leaving the user to guess which of five numbers was wrong)."""

from __future__ import annotations

import pytest

from art_adapters.backend.launch import serve


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"replicas": 0}, "replicas"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"max_seq_len": -1}, "max_seq_len"),
        ({"inference_gpu_ids": [0, 0]}, "gpu_ids"),
    ],
)
def test_nonsense_engine_flags_are_refused_naming_the_flag(given: dict[str, object], named: str) -> None:
    with pytest.raises(SystemExit) as refused:
        serve(**given)  # type: ignore[arg-type]
    message = str(refused.value)
    assert named.replace("_", "-") in message or named in message, message
