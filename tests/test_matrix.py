"""The framework matrix: real third-party agent frameworks, each wrapped as its docs show, run a group of rollouts
with a tool against the tiny Qwen3 model on vLLM (steered through `matrix/steering.py`, which the capture never
sees), each in its own environment where its pins conflict with ours (`matrix/envs.py`).

Per framework: every request the framework made is one captured call of the right rollout; each call's prompt and
completion ids and logprobs equal what vLLM returned (parsed by the proxy, apart from the capture); the sources and
the chaining are as declared; one GRPO step trains exactly the sampled tokens. Each row lands in
`build/matrix.json`; `python tests/matrix/table.py` writes the docs' table (docs/frameworks/index.md) from it.

Every framework whose calls report an agent or a node (`PER_AGENT` in its module) also runs per agent
(`test_framework_per_agent`): each call reaches vLLM as its agent's adapter.
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
from art_adapters.agent_adapters import AGENT_METRICS, SHARED, served_name
from art_adapters.doctor import diagnose
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.tiny import tiny_model_path
from art_adapters.training.tokenize import tokenize_trajectory

MATRIX = Path(__file__).parent / "matrix"
sys.path.insert(0, str(MATRIX))

from common import ANSWER, rollout_of  # noqa: E402
from envs import FRAMEWORKS, python_for  # noqa: E402
from steering import Exchange, SteeringProxy  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]
RESULTS = Path(__file__).parents[1] / "build" / "matrix.json"
ROLLOUTS = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Any, Any, SteeringProxy, VLLMServer]]:
    """vLLM on the tiny Qwen3 model, a LocalBackend with one LoRA model on it, the steering proxy in front (and
    vLLM itself, asked directly which adapters it serves)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("matrix")
    path = longer_context(tiny_model_path("qwen3"), root / "tiny-qwen3-8k")
    # the scripted model never thinks, so no reasoning parser: its answers stay content (test_fidelity_families
    # covers Qwen3's thinking turns)
    # max_loras 4: a per-agent model of two agents serves three adapters at once, plus one loading
    config = InferenceConfig(max_lora_rank=8, max_loras=4, reasoning_parser=None, max_model_len=8192)
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
        yield backend, model, proxy, server
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


async def run_framework(
    framework: str,
    model: Any,
    proxy: SteeringProxy,
    rollouts: int,
    tmp_path: Path,
    per_agent: str | None = None,
) -> tuple[dict[str, Any], list[Exchange]]:
    """Runs `rollouts` of the framework in its environment against `model` (through the steering proxy): what
    run.py wrote, and the exchanges the proxy saw for it."""
    module = importlib.import_module(f"frameworks.{framework}")
    python = await asyncio.to_thread(python_for, module.ENV)
    out = tmp_path / "run.json"
    before = len(proxy.exchanges)
    process = await asyncio.create_subprocess_exec(
        str(python), str(MATRIX / "run.py"), framework,
        "--base-url", proxy.base_url(framework), "--api-key", model.inference_api_key or "",
        "--model", model.get_inference_name(), "--rollouts", str(rollouts), "--out", str(out),
        *(["--per-agent", per_agent] if per_agent is not None else []),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    printed, _ = await process.communicate()
    assert process.returncode == 0 and out.exists(), printed.decode()[-4000:]
    return json.loads(out.read_text()), [e for e in proxy.exchanges[before:] if e.framework == framework]


@pytest.mark.parametrize("framework", FRAMEWORKS)
async def test_framework(
    framework: str, stack: tuple[Any, Any, SteeringProxy, VLLMServer], tmp_path: Path
) -> None:
    backend, model, proxy, _ = stack
    module = importlib.import_module(f"frameworks.{framework}")
    run, exchanges = await run_framework(framework, model, proxy, ROLLOUTS, tmp_path)
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
        assert all(c.error is None and c.completion_token_ids for c in trajectory.llm_calls), [
            (source_of(c), c.error, len(c.completion_token_ids or [])) for c in trajectory.llm_calls
        ]
    sources = [source_of(c) for c in trajectories[0].llm_calls]
    reports = any(c.source.agent or c.source.node_path for c in calls)
    assert reports == hasattr(module, "PER_AGENT"), (
        f"calls report agents or nodes ({sources}): the framework runs per agent too (PER_AGENT)"
        if reports
        else f"PER_AGENT declared, but no call reports an agent or a node ({sources})"
    )
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

    record(framework, replace=True, row={
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
    })  # fmt: skip


def record(framework: str, row: dict[str, Any], replace: bool = False) -> None:
    """Write the framework's row of build/matrix.json (`replace`), or add `row`'s keys to it (the per-agent run)."""
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows[framework] = row if replace else {**rows.get(framework, {}), **row}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))


AGENT_FRAMEWORKS = [f for f in FRAMEWORKS if hasattr(importlib.import_module(f"frameworks.{f}"), "PER_AGENT")]
AGENT_ROLLOUTS = 2  # one group: rewards 1 and 0, an advantage for every agent


@pytest.mark.parametrize("framework", AGENT_FRAMEWORKS)
async def test_framework_per_agent(
    framework: str, stack: tuple[Any, Any, SteeringProxy, VLLMServer], tmp_path: Path
) -> None:
    """The framework, its code unchanged, against a per-agent model (`PerAgent(by, agents)` from its module's
    PER_AGENT): vLLM serves each listed agent's adapter; each call reaches vLLM as its agent's adapter (the name in
    vLLM's own answer, seen by the proxy), a call with no listed key as the shared one; one step trains each
    adapter on exactly its own calls' sampled tokens and publishes every adapter's next version."""
    backend, shared_model, proxy, server = stack
    module = importlib.import_module(f"frameworks.{framework}")
    by, agents = module.PER_AGENT
    per_agent = art.PerAgent(by=by, agents=agents)
    model = art.TrainableModel(
        name=f"agents-{framework.replace('_', '-')}", project="matrix", base_model=shared_model.base_model,
        lora=art.LoRAConfig(rank=8), adapters=per_agent,
    )  # fmt: skip
    await model.register(backend)
    key = model.get_inference_name()  # {project}/{name}: what the framework is told to call
    routing = model.agent_routing()
    assert routing is not None and sorted(routing.served) == sorted(per_agent.listed())
    assert {f"{served_name(key, a)}@0" for a in per_agent.listed()} <= await vllm_models(server)

    options = json.dumps({"by": by, "agents": agents, "served": sorted(routing.served)})
    run, exchanges = await run_framework(framework, model, proxy, AGENT_ROLLOUTS, tmp_path, options)
    assert not any(run["errors"]), next(e for e in run["errors"] if e)
    assert run["answers"] == [ANSWER] * AGENT_ROLLOUTS, run["answers"]
    trajectories = [art.Trajectory.model_validate(t) for t in run["trajectories"]]
    calls = [c for t in trajectories for c in t.llm_calls]
    assert len(calls) == len(exchanges) == module.CALLS * AGENT_ROLLOUTS

    def want(call: art.LLMCall) -> str:  # the adapter the call's source names, as vLLM serves its step 0
        return f"{served_name(key, per_agent.adapter_of(call.source))}@0"

    # what vLLM received and served, paired to each call by the token ids it returned
    assert Counter((ids_of(c)[:2], want(c)) for c in calls) == Counter(
        ((tuple(e.prompt_token_ids), tuple(e.completion_token_ids)), e.served) for e in exchanges
    )
    assert Counter(e.request["model"] for e in exchanges) == Counter(want(c).partition("@")[0] for c in calls)
    assert all(c.served_model == want(c) for c in calls), [(source_of(c), c.served_model) for c in calls]
    adapters = Counter(per_agent.adapter_of(c.source) for c in calls)
    assert set(per_agent.listed()) <= set(adapters), (adapters, [source_of(c) for c in calls])

    for trajectory, reward in zip(trajectories, (1.0, 0.0), strict=True):
        trajectory.reward = reward
    config = art.TrainConfig(max_seq_len=8192)
    result = await backend.train(model, [art.TrajectoryGroup(trajectories)], config=config)
    assert result.metrics["adapters_trained"] == len(adapters)
    assert result.metrics["sampled_token_fraction"] == 1.0
    trained: dict[str, dict[str, int]] = {}
    for adapter, n in adapters.items():
        name = adapter or "shared"
        tokens = sum(
            len(c.completion_token_ids or []) for c in calls if per_agent.adapter_of(c.source) == adapter
        )
        assert result.metrics[f"agent/{name}/trained_tokens"] == tokens, (name, result.metrics)
        trained[name] = {"calls": n // AGENT_ROLLOUTS, "trained_tokens": tokens}
    assert not {m for m in result.metrics if m.startswith("agent/")} - {
        f"agent/{a}/{k}" for a in trained for k in AGENT_METRICS
    }, result.metrics  # no adapter trained that had no call
    assert await model.get_step() == 1
    assert {f"{served_name(key, a)}@1" for a in per_agent.listed()} <= await vllm_models(server)
    shared = sorted({source_of(c) for c in calls if per_agent.adapter_of(c.source) == SHARED})
    record(framework, {"per_agent": {"by": by, "adapters": trained, "shared_sources": shared}})


async def vllm_models(server: VLLMServer) -> set[str]:
    """The names vLLM itself serves (its adapters), asked directly, past the gateway."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.get(f"{server.base_url}/models", headers=server.headers)
    answer.raise_for_status()
    return {entry["id"] for entry in answer.json()["data"]}
