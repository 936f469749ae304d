"""Placement on CUDA, checked on the CPU with stand-ins: the memory plan as the default of every engine and trainer
setting left unset, GPU ids logical under an existing CUDA_VISIBLE_DEVICES, tensor parallelism x replicas checked,
overlapping GPUs refused, Unsloth/PEFT loaded onto the trainer's device, and the smaller CUDA items (rng states on
fewer GPUs, pre-Ampere dtypes, chunked prefill, Unsloth's import order and allocator setting, the pinned stack)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import art_adapters as art
from art_adapters import gpu_plan
from art_adapters.backend import local, placement, stack, trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.gpu_plan import GPUs, Plan, PlanError
from art_adapters.inference import InferenceConfig, VLLMServer
from art_adapters.tiny import tiny_model_path

EIGHT_GPUS = Plan(
    model="Qwen2.5-7B",
    placement="dedicated",
    gpu_count=8,
    gpu_memory_gib=79.2,
    trainer_gpu_ids=[0],
    inference_gpu_ids=[4, 5, 6, 7],
    tensor_parallel_size=2,
    replicas=2,
    gpu_memory_utilization=0.9,
    enable_sleep_mode=False,
    max_seq_len=8192,
    gradient_checkpointing=True,
    logprob_chunk_tokens=512,
)


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A host with 8 visible GPUs (as far as the backend asks), the tested stack, and a recorded make_plan."""
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 8)
    monkeypatch.setattr(local, "cuda_devices", lambda: 8)
    monkeypatch.setattr(stack, "check_cuda_stack", lambda: None)
    monkeypatch.setattr(GPUs, "detect", classmethod(lambda cls: GPUs(8, 79.2)))

    def make_plan(model: Any, gpus: Any, **overrides: Any) -> Plan:
        asked.append(overrides)
        given = {k: v for k, v in overrides.items() if v is not None and k in Plan.model_fields}
        return EIGHT_GPUS.model_copy(update=given)

    monkeypatch.setattr(gpu_plan, "make_plan", make_plan)
    return asked


def model_of(**internal: Any) -> art.TrainableModel:
    return art.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_path()), _internal_config=internal
    )


def test_eight_gpus_with_no_flags_get_the_plans_layout(tmp_path: Path, on_cuda: list[dict[str, Any]]) -> None:
    backend = LocalBackend(tmp_path)
    config = backend._engine_config(tiny_model_path(), model_of(), 16)
    assert (config.gpu_ids, config.tensor_parallel_size, config.replicas) == ([4, 5, 6, 7], 2, 2)
    assert config.max_model_len == 8192 and config.gpu_memory_utilization == 0.9
    assert config.sleep_mode_enabled(True) is False  # dedicated: no sleep mode
    server = VLLMServer(tiny_model_path(), config)
    server.on_cuda = True
    argv = server.command()
    for flag, value in (
        ("--tensor-parallel-size", "2"),
        ("--data-parallel-size", "2"),
        ("--max-model-len", "8192"),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-sleep-mode" not in argv and argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"


def test_every_setting_given_overrides_the_plan(tmp_path: Path, on_cuda: list[dict[str, Any]]) -> None:
    given = InferenceConfig(max_model_len=4096, gpu_ids=[6, 7], gpu_memory_utilization=0.7)
    backend = LocalBackend(tmp_path, inference=given, trainer_gpu_ids=[1])
    config = backend._engine_config(tiny_model_path(), model_of(), 16)
    assert on_cuda[-1]["max_seq_len"] == 4096 and on_cuda[-1]["trainer_gpu_ids"] == [1]
    assert on_cuda[-1]["inference_gpu_ids"] == [6, 7] and on_cuda[-1]["gpu_memory_utilization"] == 0.7
    assert config.gpu_ids == [6, 7] and config.max_model_len == 4096 and config.gpu_memory_utilization == 0.7
    assert config.replicas * config.tensor_parallel_size == 2
    settings = placement.trainer_settings(backend._base_plans[tiny_model_path()], _Trainer)
    assert settings == {"max_seq_len": 4096, "gradient_checkpointing": True, "dtype": torch.bfloat16}


def test_a_dedicated_engine_starts_without_sleep_mode(tmp_path: Path, on_cuda: list[dict[str, Any]]) -> None:
    EIGHT_GPUS.enable_sleep_mode = True  # even where a plan would have it on
    try:
        backend = LocalBackend(tmp_path, inference=InferenceConfig(gpu_ids=[1]), trainer_gpu_ids=[0])
        config = backend._engine_config(tiny_model_path(), model_of(), 16)
    finally:
        EIGHT_GPUS.enable_sleep_mode = False
    assert config.sleep_mode_enabled(True) is False and config.gpu_ids == [1]
    shared = LocalBackend(tmp_path, inference=InferenceConfig(gpu_ids=[0]), trainer_gpu_ids=[0])
    assert (
        shared._engine_config(tiny_model_path(), model_of(), 16).sleep_mode_enabled(True) is False
    )  # the plan's
    given = LocalBackend(
        tmp_path, inference=InferenceConfig(gpu_ids=[0], enable_sleep_mode=True), trainer_gpu_ids=[0]
    )
    assert given._engine_config(tiny_model_path(), model_of(), 16).sleep_mode_enabled(True) is True


class _Trainer:
    def __init__(self, base: str, *, max_seq_len: int, gradient_checkpointing: bool, dtype: Any) -> None: ...


async def test_a_plan_that_cannot_fit_is_refused_before_anything_loads(
    tmp_path: Path, on_cuda: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Plan:
        raise PlanError("Qwen3-8B bf16 needs 27.1 GiB on a 23.6 GiB GPU")

    monkeypatch.setattr(gpu_plan, "make_plan", refuse)
    backend = LocalBackend(tmp_path)
    backend._load_trainer = lambda *a: pytest.fail("loaded")  # type: ignore[method-assign,assignment,return-value]
    with pytest.raises(PlanError, match="27.1 GiB"):
        await model_of().register(backend)
    assert not backend._servers and not backend._owned


@pytest.mark.parametrize(
    ("trainer_gpus", "inference_gpus", "error"),
    [
        ([8], None, r"trainer GPU ids \[8\] do not exist: this process sees 8"),
        ([0], [3, 9], r"inference GPU ids \[9\] do not exist"),
        ([0, 1], [1, 2], "partly overlap"),
    ],
)
async def test_bad_gpus_are_refused_before_anything_loads(
    tmp_path: Path,
    on_cuda: list[dict[str, Any]],
    trainer_gpus: list[int],
    inference_gpus: list[int] | None,
    error: str,
) -> None:
    backend = LocalBackend(
        tmp_path, inference=InferenceConfig(gpu_ids=inference_gpus), trainer_gpu_ids=trainer_gpus
    )
    backend._load_trainer = lambda *a: pytest.fail("loaded")  # type: ignore[method-assign,assignment,return-value]
    with pytest.raises(ValueError, match=error):
        await model_of().register(backend)
    assert not backend._servers


def test_overlapping_gpus_are_shared_only_where_the_plan_says_so() -> None:
    assert placement.placement_of([0], [0]) == "shared"
    assert placement.placement_of([0], [1, 2]) == "dedicated"
    assert placement.placement_of([0], [0, 1], planned="shared") == "shared"
    with pytest.raises(ValueError, match="partly overlap"):
        placement.placement_of([0], [0, 1])


def test_a_sharded_trainer_cannot_share_the_engines_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 2)
    backend = LocalBackend(tmp_path, trainer_processes=2)
    with pytest.raises(ValueError, match="cannot offload"):
        backend.shares_cuda_gpu(model_of(), InferenceConfig(gpu_ids=[0, 1]))
    assert backend.shares_cuda_gpu(model_of(), InferenceConfig(gpu_ids=[2, 3])) is False


def test_tensor_parallel_times_replicas_must_equal_the_gpus() -> None:
    assert InferenceConfig(gpu_ids=[0, 1, 2, 3], replicas=2, tensor_parallel_size=2).tensor_parallel_size == 2
    assert InferenceConfig(gpu_ids=[0, 1, 2, 3], replicas=2).tensor_parallel_size == 2  # derived
    assert InferenceConfig(gpu_ids=[0, 1]).tensor_parallel_size == 2  # both GPUs serve, not one
    with pytest.raises(ValueError, match="replicas=1 x tensor_parallel_size=2 needs 2 gpu_ids, not 4"):
        InferenceConfig(gpu_ids=[0, 1, 2, 3], tensor_parallel_size=2)
    with pytest.raises(ValueError, match="distinct"):
        InferenceConfig(gpu_ids=[0, 0])
    assert "--tensor-parallel-size" not in VLLMServer(tiny_model_path(), InferenceConfig()).command()


def test_serve_takes_the_plans_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from art_adapters.backend import launch

    made: list[Any] = []
    monkeypatch.setattr(local, "LocalBackend", lambda **kwargs: made.append(kwargs))
    monkeypatch.setattr(uvicorn, "Server", lambda config: types.SimpleNamespace(run=lambda: None))
    monkeypatch.setattr(launch, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(launch, "uvicorn_config", lambda *a, **k: None)
    launch.serve_command([])
    assert made[0]["inference"].model_fields_set == {"limits"}  # nothing else given: the plan decides
    argv = ["--tensor-parallel-size", "2", "--max-seq-len", "8192", "--gpu-memory-utilization", "0.85"]
    launch.serve_command(
        [*argv, *[a for g in (4, 5, 6, 7) for a in ("--inference-gpu", str(g))], "--replicas", "2"]
    )
    inference = made[1]["inference"]
    assert (inference.tensor_parallel_size, inference.replicas, inference.gpu_ids) == (2, 2, [4, 5, 6, 7])
    assert inference.max_model_len == 8192 and inference.gpu_memory_utilization == 0.85
    with pytest.raises(SystemExit, match="needs 2 gpu_ids, not 3"):
        launch.serve_command(
            [
                "--tensor-parallel-size",
                "2",
                *["--inference-gpu", "0"] * 1,
                "--inference-gpu",
                "1",
                "--inference-gpu",
                "2",
            ]
        )


def test_gpu_ids_are_logical_under_an_existing_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_adapters.training.launcher import host_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert (
        VLLMServer(tiny_model_path(), InferenceConfig(gpu_ids=[1])).environment()["CUDA_VISIBLE_DEVICES"]
        == "5"
    )
    assert host_env(True, "token", [0, 3])["CUDA_VISIBLE_DEVICES"] == "4,7"
    with pytest.raises(
        ValueError, match="GPU id 4 does not exist.*CUDA_VISIBLE_DEVICES=4,5,6,7 shows 4 GPUs"
    ):
        VLLMServer(tiny_model_path(), InferenceConfig(gpu_ids=[4])).environment()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert host_env(True, "token", [0, 3])["CUDA_VISIBLE_DEVICES"] == "0,3"


def test_unsloth_and_peft_load_onto_the_trainers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from art_adapters.training import loading

    asked: list[dict[str, Any]] = []

    class Loaded(Exception):
        pass

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs: Any) -> Any:
            asked.append(kwargs)
            raise Loaded

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    device = torch.device("cuda:1")
    with pytest.raises(Loaded):
        loading.load_unsloth("base", art.LoRAConfig(), torch.bfloat16, 8192, True, 0, device=device)
    assert asked[-1]["device_map"] == {"": device} and asked[-1]["max_seq_length"] == 8192

    def from_pretrained(path: str, **kwargs: Any) -> Any:
        asked.append(kwargs)
        raise Loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(Loaded):
        loading.load_peft("base", art.LoRAConfig(), torch.bfloat16, device, False)
    assert asked[-1]["device_map"] == {"": device}  # straight onto the GPU, no CPU copy first


def test_cuda_rng_states_restore_on_fewer_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from art_adapters.training import adapter_io

    restored: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append(device))
    states = [torch.zeros(16, dtype=torch.uint8) for _ in range(8)]  # an 8-GPU run's checkpoint
    for _ in range(2):
        adapter_io.restore_cuda_rng(states, tmp_path)
    assert restored == [0, 0]
    assert [r.getMessage() for r in caplog.records].count(
        f"checkpoint {tmp_path} holds the CUDA rng states of 8 GPU(s) and 1 are visible: restored 1"
    ) == 1  # warned once


def test_pre_ampere_gpus_train_in_fp32_and_refuse_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_adapters.training.loading import trainer_dtype

    cuda = torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert trainer_dtype(cuda, None) is torch.float32 and trainer_dtype(cuda, torch.float32) is torch.float32
    for half in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=r"Tesla T4, compute capability 7.5\) cannot train in"):
            trainer_dtype(cuda, half)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert trainer_dtype(cuda, None) is torch.bfloat16
    assert trainer_dtype(torch.device("cpu"), None) is torch.float32


def test_chunked_prefill_is_turned_off_on_the_cpu_only() -> None:
    server = VLLMServer(tiny_model_path(), InferenceConfig(enable_sleep_mode=True))
    assert "--no-enable-chunked-prefill" in server.command()
    server.on_cuda = True
    assert "--no-enable-chunked-prefill" not in server.command() and "--enable-sleep-mode" in server.command()


def test_an_imports_allocator_setting_stays_out_of_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_adapters import devices

    monkeypatch.setattr(devices, "_SET_BY_IMPORTS", {})
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with devices.noting_import_settings():  # as Unsloth's import does
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert "PYTORCH_ALLOC_CONF" not in VLLMServer(tiny_model_path()).environment()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")  # the user's own
    assert (
        VLLMServer(tiny_model_path()).environment()["PYTORCH_ALLOC_CONF"]
        == "garbage_collection_threshold:0.6"
    )


ORDER_PROBE = """
import sys
first = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in ("unsloth", "transformers") and name not in first:
            first.append(name)
        return None
sys.meta_path.insert(0, Watch())
from art_adapters.training.quiet import quiet_loading
with quiet_loading(unsloth={unsloth}):
    pass
import unsloth
print(first)
"""


@pytest.mark.parametrize("first", [True, False])
def test_unsloth_is_imported_before_transformers(first: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ORDER_PROBE.format(unsloth=first)], capture_output=True, text=True, timeout=300
    )
    order = done.stdout.strip().splitlines()[-1]
    assert order == ("['unsloth', 'transformers']" if first else "['transformers', 'unsloth']"), done.stderr[
        -2000:
    ]
    assert ("should be imported before" in done.stdout + done.stderr) is not first


def test_the_cuda_stack_is_checked_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pins = dict(
        line.split("==") for line in Path("constraints-cuda.txt").read_text().splitlines() if "==" in line
    )
    assert pins == stack.TESTED_CUDA_STACK  # the file and the check agree
    installed = dict(stack.TESTED_CUDA_STACK)
    monkeypatch.setattr(stack, "installed_version", lambda package: installed.get(package))
    monkeypatch.setattr(stack, "_warned", set())
    stack.check_cuda_stack()
    assert not caplog.records
    installed["transformers"], installed["vllm"] = "5.18.0", "0.32.1"
    stack.check_cuda_stack()
    assert (
        "transformers 5.18.0 (tested 5.17.0)" in caplog.text and "vllm 0.32.1 (tested 0.32.0)" in caplog.text
    )
    installed["vllm"] = "0.33.0"
    with pytest.raises(
        RuntimeError, match="vLLM 0.33.0 is installed; this backend was checked against 0.32.0"
    ):
        stack.check_cuda_stack()
    monkeypatch.setenv(stack.ALLOW_ENV, "1")
    stack.check_cuda_stack()
    del installed["vllm"]
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        stack.check_cuda_stack()


def test_the_engines_sequence_length_and_the_plan_reach_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from art_adapters.training import trainer as trainer_module

    made: list[dict[str, Any]] = []

    class Recorder:
        step = 0

        def __init__(self, base: str, lora: Any, *, device: str | None = None, **kwargs: Any) -> None:
            made.append({"device": device, **kwargs})

        def save(self, directory: Path) -> Path:
            (directory / "adapter_config.json").write_text("{}")
            return directory

        def load(self, directory: Path) -> None: ...

        def close(self) -> None: ...

    monkeypatch.setattr(trainer_module, "Trainer", Recorder)
    backend = LocalBackend(tmp_path)
    model = model_of()
    directory = backend.model_dir(model)
    backend._model_max_len[directory] = 4096
    backend._load_trainer(model, directory)
    assert made[-1] == {"device": None, "max_seq_len": 4096}  # CPU: no plan, the engine's length
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 8)
    backend._model_plans[directory] = EIGHT_GPUS.model_copy(update={"trainer_gpu_ids": [2]})
    backend._load_trainer(model, directory)
    assert made[-1]["device"] == "cuda:2" and made[-1]["max_seq_len"] == 4096  # the engine's, as served
    assert made[-1]["gradient_checkpointing"] is True and made[-1]["dtype"] is torch.bfloat16
    assert made[-1]["logprob_chunk_tokens"] == 512  # the plan's decisions


def test_one_cpu_engine_runs_in_one_process_fewer_and_cuda_or_scale_out_keeps_vllms_default() -> None:
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    assert VLLMServer(tiny_model_path()).environment()[key] == "0"  # one torch+vLLM import fewer at start-up
    for config in (InferenceConfig(replicas=2), InferenceConfig(tensor_parallel_size=2)):
        assert key not in VLLMServer(tiny_model_path(), config).environment()  # they need their processes
    server = VLLMServer(tiny_model_path())
    server.on_cuda = True
    assert key not in server.environment()
    operator = InferenceConfig(extra_env={key: "1"})  # an operator's setting wins
    assert VLLMServer(tiny_model_path(), operator).environment()[key] == "1"
