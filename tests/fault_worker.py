"""A sharded trainer's process with one fault to inject (tests only): the real worker, its `run` wrapped to read
ART_TEST_FAULT_FILE before each command. The file holds `KIND RANK OP` (KIND: raise, kill or hang) and is consumed
by the rank that injects it, so a trainer started after the fault runs clean. KIND `kill@ADAPTER`: a per-agent
trainer's rank is SIGKILLed mid-command, as it makes that agent's adapter active (after the adapters before it
have stepped)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from art_adapters.training import worker

_run = worker.run


def run_with_fault(trainer: Any, command: dict[str, Any]) -> dict[str, Any]:
    path = os.environ.get("ART_TEST_FAULT_FILE", "")
    if path and os.path.exists(path):
        kind, rank, op = open(path).read().split()
        if int(rank) == int(os.environ["RANK"]) and op == command["op"]:
            os.remove(path)
            if kind == "raise":
                raise RuntimeError(f"injected fault on rank {rank}")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":
                time.sleep(3600)
            if kind.startswith("kill@"):
                return _killed_at(kind.partition("@")[2], trainer, command)
    return _run(trainer, command)


def _killed_at(adapter: str, trainer: Any, command: dict[str, Any]) -> dict[str, Any]:
    use = trainer.use

    def use_or_die(name: str) -> None:
        if name == adapter:
            os.kill(os.getpid(), signal.SIGKILL)
        use(name)

    trainer.use = use_or_die
    try:
        return _run(trainer, command)
    finally:
        del trainer.use


worker.run = run_with_fault

if __name__ == "__main__":
    worker.main()
