"""ART's on-disk layout (`.art/{project}/models/{name}/...`) with atomic checkpoint saves and resume helpers.

A checkpoint is written into a hidden temp dir beside its final place, fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .agent_adapters import check_adapter_name, is_adapter_name
from .trajectories import Trajectory, write_jsonl
from .untrusted import parse_step

_TEMP_PREFIX = ".tmp-"
# What a checkpoint holds for the trainer alone (resume): never shipped with a deployed adapter.
TRAINER_ONLY_FILES = frozenset({"optimizer.pt", "trainer_state.json"})


def model_dir(project: str, name: str, art_path: str | Path = ".art") -> Path:
    return Path(art_path) / project / "models" / name


def checkpoints_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / "checkpoints"


def checkpoint_dir(model_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(model_dir) / f"{step:04d}"


AGENTS_DIR = (
    "agents"  # per-agent adapters (`art.PerAgent`): `{step}/agents/{adapter}/`, the shared one at `{step}/`
)


def agent_checkpoint_dir(checkpoint: str | Path, adapter: str) -> Path:
    """Where a checkpoint keeps one agent's adapter (and its optimizer state); a name that is not an adapter name
    (a path, "..") is refused, so no name read from a request becomes a path outside the checkpoint."""
    return Path(checkpoint) / AGENTS_DIR / check_adapter_name(adapter)


def checkpoint_agents(checkpoint: str | Path) -> list[str]:
    """The agents' adapters a checkpoint holds (sorted; none for a model without per-agent adapters)."""
    root = Path(checkpoint) / AGENTS_DIR
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if is_adapter_name(p.name) and not p.is_symlink() and (p / "adapter_config.json").is_file()
    )


def serving_files(checkpoint: str | Path) -> list[Path]:
    """The files of a checkpoint a server needs (the adapter and its config), not the trainer's state."""
    root = Path(checkpoint)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in TRAINER_ONLY_FILES)


def list_steps(model_dir: str | Path) -> list[int]:
    """Steps with a complete (visible) checkpoint, ascending."""
    root = checkpoints_dir(model_dir)
    if not root.is_dir():
        return []
    steps = (parse_step(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(step for step in steps if step is not None)


def latest_step(model_dir: str | Path) -> int:
    """The newest checkpoint's step; 0 when there is none."""
    steps = list_steps(model_dir)
    return steps[-1] if steps else 0


def clean_temp_dirs(model_dir: str | Path) -> list[Path]:
    """Remove the temp dirs a crashed save left behind (call on start); returns what was removed."""
    root = checkpoints_dir(model_dir)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if p.name.startswith(_TEMP_PREFIX)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def save_checkpoint(
    model_dir: str | Path, step: int, write: Callable[[Path], Any], *, overwrite: bool = False
) -> Path:
    """Atomically create `checkpoints/{step:04d}/`: `write(tmp_dir)` fills a hidden dir that is then renamed.

    A crash at any point leaves either no checkpoint of that step or the complete one, never a partial one.
    """
    root = checkpoints_dir(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(model_dir, step)
    if final.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{step:04d}-", dir=root))
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():  # overwrite: move the old one aside first (it stays hidden until deleted)
            old = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}old-{step:04d}-", dir=root))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def move_checkpoint(model_dir: str | Path, source: int, step: int) -> Path:
    """Checkpoint `source` becomes checkpoint `step` (one rename): a step that trained nothing still advances, and
    takes over the last checkpoint's folder, as in ART. Its `trainer_state.json` then records the new step (a
    crash in between is harmless: a checkpoint folder's name is its step)."""
    root = checkpoints_dir(model_dir)
    origin, final = checkpoint_dir(model_dir, source), checkpoint_dir(model_dir, step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    os.rename(origin, final)
    _fsync_dir(root)
    state = final / "trainer_state.json"
    if state.exists():
        info = json.loads(state.read_text())
        info["step"] = step
        tmp = state.with_name(f".{state.name}.tmp")
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, state)
    return final


def delete_checkpoints(model_dir: str | Path, keep: set[int]) -> list[int]:
    """Delete every checkpoint whose step is not in `keep`; returns the deleted steps."""
    deleted = []
    for step in list_steps(model_dir):
        if step in keep:
            continue
        path = checkpoint_dir(model_dir, step)
        hidden = path.with_name(f"{_TEMP_PREFIX}del-{path.name}")
        os.rename(path, hidden)  # invisible at once, even if the removal below is interrupted
        shutil.rmtree(hidden, ignore_errors=True)
        deleted.append(step)
    return deleted


def append_history(model_dir: str | Path, record: dict[str, Any]) -> Path:
    """Append one JSON line (a step's metrics) to `history.jsonl`."""
    path = Path(model_dir) / "history.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def read_history(model_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(model_dir) / "history.jsonl"
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def trajectories_path(model_dir: str | Path, split: str, step: int) -> Path:
    return Path(model_dir) / "trajectories" / split / f"{step:04d}.jsonl"


def write_trajectories(
    model_dir: str | Path, split: str, step: int, trajectories: Iterable[Trajectory]
) -> Path:
    """Write `trajectories/{split}/{step:04d}.jsonl`."""
    return write_jsonl(trajectories_path(model_dir, split, step), trajectories)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
