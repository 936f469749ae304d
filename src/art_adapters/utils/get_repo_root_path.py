"""`art_adapters.utils.get_repo_root_path` (ART's path): the git repository the script runs in, where ART's example
scripts keep their `.art` folder and benchmark charts."""

from __future__ import annotations

from pathlib import Path


def get_repo_root_path() -> str:
    """The nearest folder at or above the working directory holding `.git`, else "." (ART's fallback)."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return str(folder)
    return "."


__all__ = ["get_repo_root_path"]
