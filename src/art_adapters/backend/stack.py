"""The CUDA install this code was checked against (constraints-cuda.txt), and the start-up check of what is
installed: a vLLM other than 0.32.x is refused (guarded_vllm and the sleep/LoRA routes depend on its internals),
any other difference is one warning naming each package."""

from __future__ import annotations

import logging
import os
from importlib import metadata

log = logging.getLogger("art_adapters.backend.local")

# Keep equal to constraints-cuda.txt (tests/test_shared_gpu_order.py checks that they agree).
TESTED_CUDA_STACK = {
    "vllm": "0.32.0",
    "torch": "2.13.0",
    "unsloth": "2026.10.9",
    "unsloth_zoo": "2026.10.9",
    "transformers": "5.17.0",
    "peft": "0.21.2",
}
REQUIRED_VLLM = "0.32"  # the minor version guarded_vllm's route guard and the engine calls were read against
ALLOW_ENV = "ART_ADAPTERS_ALLOW_UNTESTED_VLLM"
_warned: set[str] = set()


def installed_version(package: str) -> str | None:
    """The installed distribution's version without a local tag ("2.13.0+cu128" → "2.13.0"), or None."""
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def stack_differences() -> dict[str, tuple[str, str | None]]:
    """Each package whose installed version differs from the tested one: name → (tested, installed or None)."""
    differences = {}
    for package, tested in TESTED_CUDA_STACK.items():
        found = installed_version(package)
        if found != tested:
            differences[package] = (tested, found)
    return differences


def check_cuda_stack() -> None:
    """At a LocalBackend's start on CUDA: refuse a vLLM outside 0.32.x (set ART_ADAPTERS_ALLOW_UNTESTED_VLLM=1 to
    try one anyway), and warn once about every other package that differs from constraints-cuda.txt."""
    differences = stack_differences()
    vllm = differences.get("vllm", (TESTED_CUDA_STACK["vllm"], TESTED_CUDA_STACK["vllm"]))[1]
    install = "pip install 'art-adapters[backend]' -c constraints-cuda.txt"
    if vllm is None:
        raise RuntimeError(
            f"vLLM is not installed: the CUDA backend needs vllm=={TESTED_CUDA_STACK['vllm']} ({install})"
        )
    if (
        not (vllm == REQUIRED_VLLM or vllm.startswith(REQUIRED_VLLM + "."))
        and os.environ.get(ALLOW_ENV) != "1"
    ):
        raise RuntimeError(
            f"vLLM {vllm} is installed; this backend was checked against {TESTED_CUDA_STACK['vllm']} and relies on "
            f"its internals (the route guard, sleep mode, LoRA loading): {install}, or set {ALLOW_ENV}=1 to try it"
        )
    report = ", ".join(
        f"{package} {found or 'missing'} (tested {tested})"
        for package, (tested, found) in sorted(differences.items())
    )
    if report and report not in _warned:
        _warned.add(report)
        log.warning("the CUDA install differs from constraints-cuda.txt: %s (%s)", report, install)
