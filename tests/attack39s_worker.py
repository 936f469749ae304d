"""A sharded trainer's process (tests only) whose rank 0 finds a rebuild's temporary checkpoint gone when it reads
it back, as a temporary-directory cleaner would leave it: the real worker, `PerAgentTrainer.load_agents` wrapped."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from art_adapters.training import worker
from art_adapters.training.per_agent import PerAgentTrainer

_load_agents = PerAgentTrainer.load_agents


def load_agents_gone(self: PerAgentTrainer, directory: str | Path, agents: Sequence[str]) -> None:
    folder = Path(directory)
    if self.parallel is not None and self.parallel.leader and folder.name.startswith("art-trainer-grow-"):
        shutil.rmtree(folder)
    _load_agents(self, directory, agents)


PerAgentTrainer.load_agents = load_agents_gone  # type: ignore[method-assign]

if __name__ == "__main__":
    worker.main()
