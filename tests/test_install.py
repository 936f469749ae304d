"""`make venv` on a fresh machine: the CPU torch comes from a local wheel folder when pip finds one, else from
PyTorch's CPU index (PyPI does not host `torch==2.13.0+cpu`). Checked with `make torch-source`, the decision the
install's shell makes (pip asked offline; nothing installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def planned_install(env: dict[str, str], tmp_path: Path) -> str:
    done = subprocess.run(
        ["make", "-s", "torch-source", f"VENV={tmp_path / 'venv'}", f"PROBE_PIP={sys.executable} -m pip"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_a_machine_without_the_cpu_wheel_uses_pytorchs_index(tmp_path: Path) -> None:
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    bare.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")  # no local wheel folder; asks no network either
    assert INDEX in planned_install(bare, tmp_path)


def test_a_machine_whose_pip_finds_the_cpu_wheel_asks_no_other_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(
        wheels / "torch-2.13.0+cpu-py3-none-any.whl", "w"
    ) as wheel:  # a stand-in pip accepts
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(wheels))
    planned = planned_install(env, tmp_path)
    assert INDEX not in planned and planned == f"--find-links {tmp_path / 'venv'}/wheels", planned
