"""Which environment each framework of the matrix runs in, and making those environments.

"main" is the dev environment (`make venv`). The others are created on first use under `.venv-matrix/<env>` from
`envs/<env>.txt` (pinned: the resolver is slow on these trees and a pin keeps the matrix reproducible), because
their pins conflict with ours or with each other (crewai wants openai < 3, autogen-core protobuf 5, Google ADK its
own OpenTelemetry). art_adapters itself comes from `src/` on the runner's path; its light deps are in each file.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).parents[2]
FRAMEWORKS = [
    "openai_loop",
    "langchain_agent",
    "langgraph_supervisor",
    "langgraph_swarm",
    "openai_agents_chat",
    "openai_agents_handoff",
    "deepagents_agent",
    "pydantic_ai_agent",
    "smolagents_agent",
    "llamaindex_agent",
    "dspy_react",
    "autogen_agent",
    "crewai_crew",
    "google_adk_agent",
    "langchain_mcp",
    "art_mcp_toolset",
]


def python_for(env: str) -> Path:
    """The interpreter of `env`, creating the environment once (a file lock keeps parallel runs apart)."""
    if env == "main":
        return Path(sys.executable)
    home = ROOT / ".venv-matrix" / env
    python = home / "bin" / "python"
    requirements = Path(__file__).parent / "envs" / f"{env}.txt"
    done = home / ".installed"
    home.parent.mkdir(exist_ok=True)
    with open(home.parent / f".{env}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and done.read_text() == requirements.read_text():
            return python
        print(f"[matrix] creating {home} from {requirements.name} (once)", flush=True)
        venv.create(home, with_pip=False, clear=True)
        subprocess.run(
            [*installer(), "pip", "install", "--quiet", "--python", str(python), "-r", str(requirements)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        done.write_text(requirements.read_text())
    return python


def installer() -> list[str]:
    """uv, as `make venv` installs it beside the dev interpreter: the pinned files install in parallel (pip took
    minutes per environment on CI's 2 cores). `python -m uv` where the script is not beside the interpreter."""
    beside = Path(sys.executable).parent / "uv"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "uv"]
