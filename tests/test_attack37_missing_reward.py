"""Attack on 'a missing reward is never a zero' (issue 37 §3), one rule in every importer: `missing_reward=` must be
a finite number everywhere (the OTLP endpoint refuses NaN; read_otlp and the Langfuse import took it and made NaN
rewards), and a Langfuse `reward(scores)` that gives NaN or infinity is no reward (as the OTLP path has it: an own
trace keeps its recorded reward, another is skipped and counted), never a NaN that makes the training step raise."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.tracing.otel_genai import read_otlp
from test_missing_reward import otlp_trace, write_traces


@pytest.mark.parametrize("bad", [math.nan, math.inf, "0.5"])
def test_read_otlp_refuses_a_missing_reward_that_is_not_a_finite_number(tmp_path: Path, bad: Any) -> None:
    path = write_traces(tmp_path / "t.jsonl", otlp_trace("a" * 32, None))
    with pytest.raises(ValueError, match="missing_reward"):
        read_otlp(path, reward="app.reward", missing_reward=bad)


def test_langfuse_import_treats_a_non_finite_reward_as_missing() -> None:
    pytest.importorskip("langfuse")
    from art_adapters.testing.langfuse_api import LangfuseAPIServer
    from art_adapters.tracing.langfuse import import_trajectories
    from test_langfuse_import import export, keys, rich_trajectory

    public, secret = keys()
    with LangfuseAPIServer(public, secret) as server:
        server.public_key, server.secret_key = public, secret  # type: ignore[attr-defined]
        export(server, art.TrajectoryGroup([rich_trajectory(time.time() - 30, reward=1.0)]))
        assert server.wait_for(1, scores=1)

        def read(**kwargs: Any) -> Any:
            return import_trajectories(public, secret, server.base_url, progress=False, **kwargs)

        with pytest.raises(ValueError, match="missing_reward"):
            read(missing_reward=math.nan)
        for failed in (math.nan, math.inf):  # a judge's combination that failed: no reward, so the own
            kept = read(reward=lambda scores, v=failed: v).to_list()  # trace keeps the one it recorded
            assert [t.reward for t in kept] == [1.0]
