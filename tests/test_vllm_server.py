"""The managed vLLM server against the real vllm on the tiny model: token ids, logprobs, LoRA hot-loading, lifecycle."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from art_adapters.inference import InferenceConfig, InferenceServerError, VLLMServer, write_zero_adapter
from art_adapters.inference.vllm_server import group_pids
from fixtures_vllm import WEATHER_TOOLS as TOOLS
from fixtures_vllm import chat, chat_stream

vllm = pytest.mark.vllm
aio = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21C sunny"},
    {"role": "user", "content": "And tomorrow?"},
]
SAMPLE: dict[str, Any] = {
    "messages": MESSAGES,
    "max_tokens": 16,
    "seed": 1234,
    "logprobs": True,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def expected_prompt_ids(tokenizer: Any, tools: list[dict[str, Any]] | None = TOOLS) -> list[int]:
    return tokenizer.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def forward_logprobs(
    model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(completion)), torch.tensor(completion)].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def sampled(resp: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    choice = resp["choices"][0]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert len(choice["token_ids"]) == len(lps) == resp["usage"]["completion_tokens"]
    return resp["prompt_token_ids"], choice["token_ids"], lps


def write_adapter(base: Path, out: Path, *, seed: int, rank: int = 8, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter with random (non-zero) lora_B, so it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, scale)
    peft_model.save_pretrained(out)
    return out


def peft_model_of(base: Path, adapter: Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


@vllm
@aio
async def test_token_ids_and_logprobs_match_transformers(
    vllm_server: VLLMServer, hf: tuple[Any, Any]
) -> None:
    model, tok = hf
    resp = await chat(vllm_server, {**SAMPLE, "tools": TOOLS, "temperature": 1.0})
    prompt, completion, lps = sampled(resp)
    assert prompt == expected_prompt_ids(tok)
    diff = max_diff(lps, forward_logprobs(model, prompt, completion))
    print(f"\n[vllm] logprob max abs diff vs transformers (T=1.0): {diff:.2e}")
    assert diff <= 1e-4
    # processed_logprobs: the reported logprobs are those of the temperature-scaled distribution.
    resp = await chat(vllm_server, {**SAMPLE, "tools": TOOLS, "temperature": 0.7})
    prompt, completion, lps = sampled(resp)
    diff = max_diff(lps, forward_logprobs(model, prompt, completion, temperature=0.7))
    print(f"[vllm] logprob max abs diff vs transformers (T=0.7, processed): {diff:.2e}")
    assert diff <= 1e-4
    # without tools, the prompt has no tool system block
    resp = await chat(vllm_server, {**SAMPLE, "max_tokens": 2})
    assert resp["prompt_token_ids"] == expected_prompt_ids(tok, tools=None)


@vllm
@aio
async def test_streaming_token_ids_and_logprobs(vllm_server: VLLMServer, hf: tuple[Any, Any]) -> None:
    model, tok = hf
    body = {**SAMPLE, "tools": TOOLS, "stream_options": {"include_usage": True}}
    chunks = await chat_stream(vllm_server, body)
    prompt = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
    completion: list[int] = []
    lps: list[float] = []
    for c in chunks:
        for choice in c.get("choices", []):
            completion += choice.get("token_ids") or []
            lps += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert prompt == expected_prompt_ids(tok)
    assert len(completion) == len(lps) == usage["completion_tokens"] > 0
    assert max_diff(lps, forward_logprobs(model, prompt, completion)) <= 1e-4


@vllm
@aio
async def test_lora_hot_load_replace_and_zero_adapter(
    vllm_server: VLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    body = {**SAMPLE, "temperature": 1.0}
    base = sampled(await chat(vllm_server, body))

    path_a = write_adapter(tiny_model, tmp_path / "step-1", seed=1)
    ms = await vllm_server.load_lora("t-step-1", path_a)
    print(f"\n[vllm] LoRA load {ms:.1f} ms")
    prompt, comp_a, lps_a = sampled(await chat(vllm_server, body, model="t-step-1"))
    assert prompt == base[0]
    assert (comp_a, lps_a) != (base[1], base[2])
    diff_a = max_diff(lps_a, forward_logprobs(peft_model_of(tiny_model, path_a), prompt, comp_a))
    print(f"[vllm] adapter logprob max abs diff vs PEFT: {diff_a:.2e}")
    assert diff_a <= 1e-4

    path_b = write_adapter(tiny_model, tmp_path / "step-2", seed=2)
    await vllm_server.load_lora("t-step-2", path_b)
    await vllm_server.unload_lora("t-step-1")
    _, comp_b, lps_b = sampled(await chat(vllm_server, body, model="t-step-2"))
    assert (comp_b, lps_b) != (comp_a, lps_a)
    assert max_diff(lps_b, forward_logprobs(peft_model_of(tiny_model, path_b), prompt, comp_b)) <= 1e-4
    served = {m["id"] for m in (await _models(vllm_server))}
    assert "t-step-2" in served and "t-step-1" not in served

    # A served name is immutable: other weights under it are refused (a new version gets a new name); the same
    # folder again is a no-op.
    with pytest.raises(InferenceServerError, match="new version needs a new name"):
        await vllm_server.load_lora("t-step-2", path_a)
    assert await vllm_server.load_lora("t-step-2", path_b) == 0.0
    again = sampled(await chat(vllm_server, body, model="t-step-2"))
    assert again[1] == comp_b and max_diff(again[2], lps_b) <= 1e-5

    zero = write_zero_adapter(tiny_model, tmp_path / "zero", rank=8)
    await vllm_server.load_lora("t-base-zero", zero)
    z = sampled(await chat(vllm_server, body, model="t-base-zero"))
    assert z[1] == base[1] and max_diff(z[2], base[2]) <= 1e-5
    for name in ["t-step-2", "t-base-zero"]:
        await vllm_server.unload_lora(name)


async def _models(server: VLLMServer) -> list[dict[str, Any]]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{server.base_url}/models", headers=server.headers)
    r.raise_for_status()
    return r.json()["data"]


@vllm
@aio
async def test_rank_above_max_lora_rank_is_refused(
    vllm_server: VLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    big = write_adapter(tiny_model, tmp_path / "r32", seed=3, rank=32)
    with pytest.raises(ValueError, match=r"rank r=32 > max_lora_rank=16"):
        await vllm_server.load_lora("too-big", big)
    with pytest.raises(ValueError, match="adapter_config.json"):
        await vllm_server.load_lora("nothing", tmp_path)
    assert all(m["id"] != "too-big" for m in await _models(vllm_server))


def test_client_side_import_needs_no_torch_or_vllm() -> None:
    code = "import sys, art_adapters.inference; assert not {'torch', 'vllm'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bad_model_folders_fail_before_any_process(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        VLLMServer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        VLLMServer(tmp_path / "empty")


@vllm
@aio
async def test_port_in_use_and_death_during_startup(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = InferenceConfig(extra_args=["--no-such-flag"], warmup=False, startup_timeout_s=180)
        server = VLLMServer(tiny_model, cfg, port=port, log_path=tmp_path / "bad.log")
        t0 = time.perf_counter()
        with pytest.raises(InferenceServerError, match="no-such-flag") as info:
            await server.start()
    print(f"\n[vllm] bad-arg start-up failed after {time.perf_counter() - t0:.1f} s")
    assert "during start-up" in str(info.value)
    assert server.port != port and server.port is not None
    assert str(server.port) in " ".join(server.command())
    assert not server.running


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from art_adapters.inference import InferenceConfig, VLLMServer

    async def main() -> None:
        server = VLLMServer(sys.argv[1], InferenceConfig(warmup=False), log_path=sys.argv[2])
        await server.start()
        print("READY", server.process.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@vllm
def test_sigkilled_parent_leaves_no_vllm_process(tiny_model: Path, tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model), str(tmp_path / "orphan.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.startswith("READY"), (line, (tmp_path / "orphan.log").read_text()[-3000:])
        pgid = int(line.split()[1])
        members = group_pids(pgid)
        assert len(members) >= 3, members  # supervisor, API server, EngineCore (+ worker)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 30
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = group_pids(pgid)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned vLLM processes: {left}"


@vllm
@aio
async def test_every_vllm_route_needs_the_key_and_the_key_is_not_on_the_command_line(
    vllm_server: VLLMServer,
) -> None:
    """vLLM's own key guards only /v1; its dev routes would answer any local process. Ours guard all of them."""
    import httpx

    root = vllm_server.root_url
    probes = [
        ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc"),
        ("POST", "/sleep"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    ]
    async with httpx.AsyncClient(timeout=30) as client:
        for method, path in probes:
            r = await client.request(method, root + path, json={"method": "x"})
            assert r.status_code == 401, (path, r.status_code, r.text[:200])
        r = await client.post(root + "/reset_prefix_cache", headers=vllm_server.headers)
        assert r.status_code == 200 and "success" in r.json()
    assert vllm_server.process is not None
    key = vllm_server.api_key.encode()
    for pid, cmdline in command_lines(group_pids(vllm_server.process.pid)):
        assert key not in cmdline, f"the key is visible in the command line of pid {pid}"


def command_lines(pids: list[int]) -> list[tuple[int, bytes]]:
    return [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()) for pid in pids]


def test_engine_flags_and_the_key_travel_as_configured(tiny_model: Path) -> None:
    server = VLLMServer(
        tiny_model, InferenceConfig(enforce_eager=True, max_num_seqs=8, extra_env={"VLLM_API_KEY": ""})
    )
    command = server.command()
    assert command[1:3] == ["-m", "art_adapters.inference.guarded_vllm"]
    assert "--enforce-eager" in command and command[command.index("--max-num-seqs") + 1] == "8"
    assert "--api-key" not in command and server.api_key not in " ".join(command)
    assert server.environment()["VLLM_API_KEY"] == server.api_key  # operator settings cannot unset the guard


def test_the_guarded_launcher_refuses_to_start_without_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "art_adapters.inference.guarded_vllm", "--model", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "refusing to start an unguarded server" in done.stderr
