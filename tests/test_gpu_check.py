"""`make gpu-check` on the CPU: the dry run of bench/gpu_check.py end to end (stand-in processes, ART's shared order,
the JSON and the table), the vLLM memory stand-in's HTTP contract, and the failure paths the GPU run relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SHARED_ORDER = ["sleep", "empty_cache", "reload", "step", "save", "offload", "empty_cache", "wake"]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """The bench scripts as modules (they import each other by their file names)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check
    import gpu_check_case
    import gpu_standin

    yield {"check": gpu_check, "case": gpu_check_case, "standin": gpu_standin}


def dry_plans(tmp_path: Path) -> list[str]:
    """`--plan-json` while this checkout's make_plan is not implemented (the real plan is used once it is)."""
    from art_adapters.gpu_plan import GPUs, make_plan

    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    try:
        make_plan(folder, GPUs(1, 79.2), max_seq_len=128)
    except NotImplementedError:
        pass
    except Exception:  # implemented (this probe's empty config is refused): the script plans for itself
        return []
    else:
        return []
    common = {"model": "tiny", "placement": "shared", "gpu_count": 1, "enable_sleep_mode": True}
    common |= {"max_seq_len": 128, "gradient_checkpointing": True, "logprob_chunk_tokens": 32}
    plans = {
        "qwen2.5-7b": common
        | {"gpu_memory_gib": 79.2, "gpu_memory_utilization": 0.7, "kv_cache_tokens": 100_000_000}
        | {"micro_batch_tokens": 128, "estimates_gib": {"vllm_asleep": 2.0, "training_total": 4.0}},
        "qwen2.5-3b-24gb": common
        | {"gpu_memory_gib": 23.6, "gpu_memory_utilization": 0.6, "kv_cache_tokens": 20_000_000}
        | {"micro_batch_tokens": 256},
    }
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(plans))
    return ["--plan-json", str(path)]


@pytest.mark.train
def test_dry_run_runs_the_shared_order_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--out", str(out), *dry_plans(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["within_budget"]
    assert [c["case"] for c in report["cases"]] == ["qwen2.5-7b", "qwen2.5-3b-24gb"]
    for case in report["cases"]:
        assert case["error"] is None and case["fits"] is True, case
        assert (out / f"{case['case']}.log").read_text() == ""  # no stray warnings from the libraries
        events = [e["event"] for e in case["events"]]
        setup = events[: events.index("sleep")]
        expected = [
            "plan",
            "trainer_loaded",
            "standalone_step",
            "offload_cycle",
            "offload",
            "standin_started",
        ]
        if case["case"] == "qwen2.5-3b-24gb":  # the smaller card is made before anything loads
            expected.insert(1, "ballast")
        assert setup == expected  # ART's order: the trainer loaded and offloaded before the engine starts
        assert events[len(setup) :] == SHARED_ORDER * 3 + ["done"]
        assert [e["step"] for e in case["events"] if e["event"] == "wake"] == [1, 2, 3]
        step = case["step"]
        assert step["tokens"] == 8 * 64 and step["trained_tokens"] == 8 * 40 and step["truncated_tokens"] == 0
        assert step["tokens_per_s"] > 0 and step["peak_reserved_gib"] > 0
        assert case["trainer"]["gradient_checkpointing"] is case["plan"]["gradient_checkpointing"]
        compared = case["against_plan"]
        assert set(compared) == {"trainer_step", "training_phase", "inference_phase"}
        assert (
            compared["training_phase"]["measured_gib"] == case["max_device_used_gib"]
            or compared["inference_phase"]["measured_gib"] == case["max_device_used_gib"]
        )
        held = case["standin"]["held_bytes"]
        for row in case["shared_steps"]:  # sleep released the weights and KV cache, wake retook them all
            assert row["standin_asleep_bytes"] < held == row["standin_awake_bytes"]
            assert row["trained_tokens"] == 8 * 40
    assert "| qwen2.5-3b-24gb |" in done.stdout and "shared step" in done.stdout


@pytest.fixture
def standin(bench: dict[str, ModuleType]) -> Iterator[tuple[Any, str]]:
    """The stand-in's engine (CPU tensors: 3 kB resident, 5 kB weights, 7 kB KV cache) behind its HTTP server."""
    module = bench["standin"]
    import torch

    engine = module.Engine(torch.device("cpu"), weights=5000, kv=7000, resident=3000, chunk=2048)
    box: list[Any] = []
    server = module.ThreadingHTTPServer(("127.0.0.1", 0), module.handler_for(engine, box))
    box.append(server)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield engine, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def call(url: str, method: str = "POST") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_standin_releases_and_retakes_its_memory_like_vllm_sleep_level_1(standin: tuple[Any, str]) -> None:
    engine, url = standin
    assert call(url + "/is_sleeping", "GET") == (200, {"is_sleeping": False, "held_bytes": 15000})
    weights = [bytes(p.tolist()) for p in engine.weights]
    status, body = call(url + "/sleep?level=1")
    assert status == 200 and body["is_sleeping"] and body["held_bytes"] == 3000  # only the resident part
    assert call(url + "/sleep?level=1")[1]["held_bytes"] == 3000  # sleeping twice changes nothing
    status, body = call(url + "/wake_up")
    assert status == 200 and not body["is_sleeping"] and body["held_bytes"] == 15000
    assert [bytes(p.tolist()) for p in engine.weights] == weights  # the weights came back from host memory
    assert call(url + "/sleep?level=2")[0] == 400  # level 2 (weights discarded) is not what it models
    assert call(url + "/nowhere")[0] == 404


def test_standin_that_cannot_wake_answers_507_and_stays_asleep_holding_nothing(
    standin: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, url = standin
    call(url + "/sleep?level=1")
    real = engine._take

    def short_of_memory(size: int) -> list[Any]:
        if size == engine.kv_bytes:  # the weights fit, the KV cache does not
            raise MemoryError("out of memory after 0.00 GiB: test")
        return real(size)

    monkeypatch.setattr(engine, "_take", short_of_memory)
    status, body = call(url + "/wake_up")
    assert status == 507 and "out of memory" in body["error"]
    assert body["is_sleeping"] and body["held_bytes"] == 3000 and engine.weights == []
    monkeypatch.setattr(engine, "_take", real)
    assert call(url + "/wake_up")[1]["held_bytes"] == 15000  # the next wake-up succeeds


class FailingTrainer:
    """A trainer whose step raises; it records what the shared sequence asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reload(self) -> None:
        self.calls.append("reload")

    def offload(self) -> None:
        self.calls.append("offload")

    def train_step(self, groups: Any, config: Any) -> Any:
        self.calls.append("train_step")
        raise RuntimeError("CUDA out of memory (test)")


def test_a_step_that_fails_still_offloads_the_trainer_and_wakes_the_engine(
    bench: dict[str, ModuleType], standin: tuple[Any, str], tmp_path: Path
) -> None:
    case = bench["case"]
    import torch

    engine, url = standin
    client = object.__new__(case.StandIn)
    client.url = url
    report = case.Report(tmp_path / "part.json", "test")
    gauge = case.Gauge(torch.device("cpu"))
    trainer = FailingTrainer()
    row: dict[str, Any] = {"step": 1}
    with pytest.raises(RuntimeError, match="out of memory"):
        case.shared_step(row, trainer, client, [], None, gauge, report, tmp_path, lambda: 0.0)
    assert row["standin_awake_bytes"] == 15000 and "step_s" not in row  # what it measured is kept
    assert trainer.calls == ["reload", "train_step", "offload"]
    events = [(e["event"], e.get("error")) for e in report.data["events"]]
    assert events == [
        ("sleep", None),
        ("empty_cache", None),
        ("reload", None),
        ("step", "RuntimeError: CUDA out of memory (test)"),
        ("offload", None),
        ("empty_cache", None),
        ("wake", None),
    ]
    assert not engine.sleeping and engine.held_bytes() == 15000


def test_a_case_past_its_time_is_killed_and_reported(
    bench: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = bench["check"]
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import json, sys, time\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "open(out, 'w').write(json.dumps({'case': 'qwen2.5-7b', 'events': [], 'error': None, 'step': {'step_s': 1.0}}))\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(check, "CASE_SCRIPT", hang)
    args = check.argparse.Namespace(dry_run=True, plan_json=None)
    result = check.run_case("qwen2.5-7b", args, tmp_path, timeout_s=5)
    assert result["error"].startswith("timed out after 5 s") and result["fits"] is False
    assert result["step"] == {"step_s": 1.0}  # what it measured before is kept


def test_unknown_case_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--cases", "qwen2.5-7b,llama", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown case(s) ['llama']" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_cases_agree_between_the_scripts(bench: dict[str, ModuleType]) -> None:
    import gpu_models

    assert set(bench["check"].CASES) == set(gpu_models.CASES) == set(gpu_models.DRY_CASES)
    assert (
        gpu_models.QWEN25_7B["vocab_size"] == 152064 and gpu_models.QWEN25_3B["tie_word_embeddings"] is True
    )


def test_a_bad_plan_json_is_refused_before_anything_runs(tmp_path: Path) -> None:
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps({"qwen2.5-7b": {"model": "x", "placement": "shared"}}))
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_check.py"),
            "--dry-run",
            "--plan-json",
            str(plans),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        timeout=120,
    )
    assert done.returncode == 2 and "the plan for qwen2.5-7b is not a Plan" in done.stderr
    assert "max_seq_len" in done.stderr and not (tmp_path / "gpu_check.json").exists()
