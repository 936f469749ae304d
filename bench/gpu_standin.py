"""Stand-ins for bench/gpu_check.py, each its own process: vLLM's memory on a shared GPU (real allocations of its
weights and KV cache, released and retaken on /sleep and /wake_up as vLLM's sleep level 1 does), and a ballast that
shrinks the free memory of a large GPU to a smaller card's size.

python bench/gpu_standin.py serve --device cuda --weights-bytes N --kv-bytes N --resident-bytes N
python bench/gpu_standin.py ballast --device cuda --leave-free-bytes N

Each prints one JSON line when ready (`{"ready": true, ...}`, the server's port among it), then runs until its
stdin closes (the parent gone), `--max-seconds` pass, or (the server) a POST to /shutdown. The server binds
127.0.0.1 and speaks vLLM's paths: POST /sleep?level=1, POST /wake_up, GET /is_sleeping.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

CHUNK_BYTES = (
    1 << 30
)  # vLLM holds many tensors; 1 GiB pieces also tell how far an allocation got before failing


class Engine:
    """What vLLM holds on its GPU: the weights and the KV cache (the two sleep mode releases) and a resident part
    that stays through sleep (CUDA graphs, the sampler's buffers, allocator slack)."""

    def __init__(self, device: torch.device, weights: int, kv: int, resident: int, chunk: int) -> None:
        self.device, self.weights_bytes, self.kv_bytes, self.chunk = device, weights, kv, chunk
        self.lock = threading.Lock()
        self.resident = self._take(resident)
        self.weights = self._take(weights)
        self.kv = self._take(kv)
        self.backup: list[torch.Tensor] = []
        self.sleeping = False

    def _take(self, size: int) -> list[torch.Tensor]:
        pieces: list[torch.Tensor] = []
        try:
            while size > 0:
                piece = torch.empty(min(size, self.chunk), dtype=torch.uint8, device=self.device)
                piece.fill_(len(pieces) % 251 + 1)  # touch every byte: the memory is really there
                pieces.append(piece)
                size -= piece.numel()
        except torch.OutOfMemoryError as error:
            got = sum(p.numel() for p in pieces)
            del pieces
            release(self.device)
            raise MemoryError(f"out of memory after {got / 2**30:.2f} GiB: {str(error)[:300]}") from None
        return pieces

    def held_bytes(self) -> int:
        """What this process holds: the caching allocator's reserve on CUDA, the tensors' bytes on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        return sum(p.numel() for p in self.resident + self.weights + self.kv)

    def sleep(self) -> None:
        """Level 1: weights copied to (pinned) host memory, KV cache discarded, the GPU memory given back."""
        with self.lock:
            if self.sleeping:
                return
            pin = self.device.type == "cuda"
            self.backup = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p) for p in self.weights]
            self.weights, self.kv = [], []
            release(self.device)
            self.sleeping = True

    def wake_up(self) -> None:
        """The weights back from host memory and a fresh KV cache; on failure it stays asleep, holding nothing."""
        with self.lock:
            if not self.sleeping:
                return
            try:
                weights = self._take(self.weights_bytes)
                for piece, saved in zip(weights, self.backup, strict=True):
                    piece.copy_(saved)
                kv = self._take(self.kv_bytes)
            except MemoryError:
                weights = kv = []
                release(self.device)
                raise
            self.weights, self.kv, self.backup = weights, kv, []
            self.sleeping = False


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def handler_for(engine: Engine, server_box: list[ThreadingHTTPServer]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet: the parent records what matters
            return

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _state(self, **extra: Any) -> dict[str, Any]:
            return {"is_sleeping": engine.sleeping, "held_bytes": engine.held_bytes(), **extra}

        def do_GET(self) -> None:
            if urlparse(self.path).path == "/is_sleeping":
                self._answer(200, self._state())
            else:
                self._answer(404, {"error": f"no such path: {self.path}"})

        def do_POST(self) -> None:
            url = urlparse(self.path)
            started = time.perf_counter()
            try:
                if url.path == "/sleep":
                    level = parse_qs(url.query).get("level", ["1"])[0]
                    if level != "1":
                        self._answer(400, {"error": f"the stand-in models sleep level 1 only, not {level}"})
                        return
                    engine.sleep()
                elif url.path == "/wake_up":
                    engine.wake_up()
                elif url.path == "/shutdown":
                    self._answer(200, self._state())
                    threading.Thread(target=server_box[0].shutdown, daemon=True).start()
                    return
                else:
                    self._answer(404, {"error": f"no such path: {url.path}"})
                    return
            except MemoryError as error:
                self._answer(507, self._state(error=str(error), seconds=time.perf_counter() - started))
                return
            self._answer(200, self._state(seconds=time.perf_counter() - started))

    return Handler


def exit_when_orphaned(max_seconds: float) -> None:
    """End the process when its parent closes our stdin (it exited, however it died), or after max_seconds."""

    def watch_stdin() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    timer = threading.Timer(max_seconds, lambda: os._exit(3))
    timer.daemon = True
    timer.start()


def ready(**fields: Any) -> None:
    print(json.dumps({"ready": True, **fields}), flush=True)


def refuse(error: str) -> None:
    print(json.dumps({"ready": False, "error": error}), flush=True)
    sys.exit(1)


def cap(device: torch.device, fraction: float | None) -> None:
    if fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def serve(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    cap(device, args.memory_fraction)
    started = time.perf_counter()
    try:
        engine = Engine(device, args.weights_bytes, args.kv_bytes, args.resident_bytes, args.chunk_bytes)
    except MemoryError as error:
        refuse(f"start-up: {error}")
        return
    box: list[ThreadingHTTPServer] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(engine, box))
    box.append(server)
    ready(
        port=server.server_address[1],
        held_bytes=engine.held_bytes(),
        start_s=time.perf_counter() - started,
        memory_fraction=args.memory_fraction if device.type == "cuda" else None,
    )
    server.serve_forever(poll_interval=0.2)


def ballast(args: argparse.Namespace) -> None:
    """Hold all of the GPU's free memory but `leave_free_bytes` (CUDA), or `bytes` on the CPU (a dry run)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
        free, _ = torch.cuda.mem_get_info(device)
        size = free - args.leave_free_bytes
        if size < 0:
            refuse(
                f"only {free / 2**30:.2f} GiB free, less than the {args.leave_free_bytes / 2**30:.2f} to leave"
            )
    else:
        size = args.bytes
    held: list[torch.Tensor] = []
    try:
        while size > 0:
            held.append(torch.empty(min(size, args.chunk_bytes), dtype=torch.uint8, device=device))
            size -= held[-1].numel()
    except torch.OutOfMemoryError as error:
        refuse(f"ballast: {str(error)[:300]}")
    free_after = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    ready(ballast_bytes=sum(t.numel() for t in held), free_after_bytes=free_after)
    threading.Event().wait()


# --- the parent's side: starting a stand-in and driving it ----------------------------------------------------------------------------------------


class Child:
    """A stand-in process: started, awaited until its ready line (bounded), ended on close."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = _read_line(self.process, timeout_s)
        self.ready: dict[str, Any] = json.loads(line) if line else {"ready": False, "error": "no ready line"}
        if not self.ready.get("ready"):
            self.close()
            raise RuntimeError(f"stand-in {argv[0]} failed: {self.ready.get('error')}")

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()  # the child exits when its stdin closes
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(process.stdout.readline() if process.stdout else ""))
    reader.daemon = True
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""


class StandIn(Child):
    """The vLLM stand-in, driven over HTTP like vLLM's dev endpoints."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        super().__init__(["serve", *argv], timeout_s)
        self.url = f"http://127.0.0.1:{self.ready['port']}"

    def post(self, path: str, timeout_s: float = 300.0) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
            raise RuntimeError(f"stand-in {path}: HTTP {error.code}: {body.get('error')}") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.post("/shutdown", timeout_s=10)
        super().close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "ballast"):
        command = sub.add_parser(name)
        command.add_argument("--device", default="cuda")
        command.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
        command.add_argument("--max-seconds", type=float, default=900.0)
    sub.choices["serve"].add_argument("--weights-bytes", type=int, required=True)
    sub.choices["serve"].add_argument("--kv-bytes", type=int, required=True)
    sub.choices["serve"].add_argument("--resident-bytes", type=int, default=0)
    sub.choices["serve"].add_argument("--memory-fraction", type=float, default=None)
    sub.choices["ballast"].add_argument("--leave-free-bytes", type=int, default=0)
    sub.choices["ballast"].add_argument("--bytes", type=int, default=0)
    args = parser.parse_args()
    exit_when_orphaned(args.max_seconds)
    serve(args) if args.command == "serve" else ballast(args)


if __name__ == "__main__":
    main()
