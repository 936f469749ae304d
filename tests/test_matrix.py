"""The framework matrix: real third-party agent frameworks, each wrapped as its docs show, run a group of rollouts
with a tool against the tiny Qwen3 model on vLLM (steered through `matrix/steering.py`, which the capture never
sees), each in its own environment where its pins conflict with ours (`matrix/envs.py`).

Per framework: every request the framework made is one captured call of the right rollout; each call's prompt and
completion ids and logprobs equal what vLLM returned (parsed by the proxy, apart from the capture); the sources and
the chaining are as declared; one GRPO step trains exactly the sampled tokens. Each row lands in
`build/matrix.json`; `python tests/matrix/table.py` writes the docs' table (docs/frameworks/index.md) from it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import art_adapters as art
from art_adapters.doctor import diagnose
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import tokenize_trajectory

MATRIX = Path(__file__).parent / "matrix"
sys.path.insert(0, str(MATRIX))

from common import ANSWER, rollout_of  # noqa: E402
from envs import FRAMEWORKS, python_for  # noqa: E402
from steering import SteeringProxy  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]
RESULTS = Path(__file__).parents[1] / "build" / "matrix.json"
ROLLOUTS = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Any, SteeringProxy]]:
    """vLLM on the tiny Qwen3 model, a LocalBackend with one LoRA model on it, the steering proxy in front."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("matrix")
    path = longer_context(tiny_model_path("qwen3"), root / "tiny-qwen3-8k")
    # the scripted model never thinks, so no reasoning parser: its answers stay content (test_fidelity_families
    # covers Qwen3's thinking turns)
    config = InferenceConfig(max_lora_rank=8, max_loras=2, reasoning_parser=None, max_model_len=8192)
    server = VLLMServer(path, config, log_path=root / "vllm.log")
    await server.start()
    backend = art.LocalBackend(root / "art").use_server(server)
    model = art.TrainableModel(
        name="matrix", project="matrix", base_model=str(path), lora=art.LoRAConfig(rank=8)
    )
    await model.register(backend)
    scripts = {name: importlib.import_module(f"frameworks.{name}").script for name in FRAMEWORKS}
    tokenizer = AutoTokenizer.from_pretrained(path)
    proxy = SteeringProxy(model.inference_base_url, model.inference_api_key, tokenizer, scripts).start()
    try:
        yield backend, model, proxy
    finally:
        proxy.stop()
        await backend.close()
        await server.stop()


def longer_context(model: Path, to: Path) -> Path:
    """The tiny model with 8192 positions instead of 2048 (smolagents' and deepagents' prompts are longer); the
    weights are the same files (a random model does not care where its positions end)."""
    to.mkdir()
    for item in model.iterdir():
        if item.name != "config.json":
            (to / item.name).symlink_to(item)
    config = json.loads((model / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return to


def ids_of(call: art.LLMCall) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """What vLLM returned, as captured. Responses give no logprob for a tool call or the stop token: the capture
    marks those NaN (counted as `ratio_missing_tokens`), so only the ones vLLM gave are compared."""
    logprobs = tuple(x for x in call.logprobs or () if not math.isnan(x))
    return tuple(call.prompt_token_ids or ()), tuple(call.completion_token_ids or ()), logprobs


def source_of(call: art.LLMCall) -> str:
    return call.source.agent or call.source.node_path or call.source.role or "-"


@pytest.mark.parametrize("framework", FRAMEWORKS)
async def test_framework(framework: str, stack: tuple[Any, Any, SteeringProxy], tmp_path: Path) -> None:
    backend, model, proxy = stack
    module = importlib.import_module(f"frameworks.{framework}")
    python = await asyncio.to_thread(python_for, module.ENV)
    out = tmp_path / "run.json"
    before = len(proxy.exchanges)
    process = await asyncio.create_subprocess_exec(
        str(python), str(MATRIX / "run.py"), framework,
        "--base-url", proxy.base_url(framework), "--api-key", model.inference_api_key or "",
        "--model", model.get_inference_name(), "--rollouts", str(ROLLOUTS), "--out", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    printed, _ = await process.communicate()
    assert process.returncode == 0 and out.exists(), printed.decode()[-4000:]
    run = json.loads(out.read_text())
    exchanges = [e for e in proxy.exchanges[before:] if e.framework == framework]
    steered = [(e.said[:60], e.request) for e in exchanges]  # what the script said, for failure messages
    assert not any(run["errors"]), (next(e for e in run["errors"] if e), steered)
    trajectories = [art.Trajectory.model_validate(t) for t in run["trajectories"]]
    last = trajectories[0].llm_calls[-1] if trajectories[0].llm_calls else None
    assert run["answers"] == [ANSWER] * ROLLOUTS, (run["answers"], last and last.response, steered)
    calls = [c for t in trajectories for c in t.llm_calls]

    # every request the framework made is one captured call, holding exactly what vLLM returned
    assert len(calls) == len(exchanges) and calls
    assert Counter(map(ids_of, calls)) == Counter(
        (tuple(e.prompt_token_ids), tuple(e.completion_token_ids), tuple(e.logprobs)) for e in exchanges
    )
    for k, trajectory in enumerate(trajectories):  # each rollout holds its own calls, and all of them
        assert len(trajectory.llm_calls) == module.CALLS, [source_of(c) for c in trajectory.llm_calls]
        markers = [rollout_of(c.request) for c in trajectory.llm_calls]
        assert markers.count(f"(rollout {k})") == module.CALLS - getattr(module, "UNMARKED", 0), markers
        assert set(markers) <= {f"(rollout {k})", ""}, markers
        assert all(c.error is None and c.completion_token_ids for c in trajectory.llm_calls)
    sources = [source_of(c) for c in trajectories[0].llm_calls]
    tokenizer = (await backend.trainer(model)).tokenizer
    sequences = [len(tokenize_trajectory(t, tokenizer, max_seq_len=8192).sequences) for t in trajectories]
    report = diagnose(trajectories, tokenizer)
    causes = {k: n for k, n in report.summary()["causes"].items() if k != "template"}
    broken = next((c for c in report.calls if c.chained is False), None)
    where = broken and f"\nsequence: {broken.sequence_window!r}\nprompt:   {broken.prompt_window!r}"
    assert sequences == [module.SEQUENCES] * ROLLOUTS, (
        f"calls that continue one another chain; {causes}{where}"
    )

    for trajectory, reward in zip(trajectories, (1.0, 0.0, 0.5), strict=True):
        trajectory.reward = reward
    config = art.TrainConfig(max_seq_len=8192)
    result = await backend.train(model, [art.TrajectoryGroup(trajectories)], config=config)
    assert result.metrics["sampled_token_fraction"] == 1.0
    assert all(t.metrics["sampled_token_fraction"] == 1.0 for t in trajectories)

    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows[framework] = {
        "name": module.NAME,
        "versions": run["versions"],
        "route": run["route"],
        "streamed": module.STREAMED,
        "calls": module.CALLS,
        "sources": sources,
        "sequences": module.SEQUENCES,
        "breaks": {cause: n // ROLLOUTS for cause, n in causes.items()},
        "why": getattr(module, "WHY", ""),
        "trained_fraction": result.metrics["sampled_token_fraction"],
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
