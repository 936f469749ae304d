"""GPU ids as this process sees them (logical, under an existing CUDA_VISIBLE_DEVICES) turned into the ids a child
process must be given: Slurm or Kubernetes may already have narrowed this process to, say, physical GPUs 4-7."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (indices, or GPU-/MIG- UUIDs), or None when it is unset (every GPU)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def child_visible_devices(gpu_ids: list[int], environ: Mapping[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that should see this process's logical GPUs `gpu_ids`: with
    CUDA_VISIBLE_DEVICES=4,5,6,7 here, [1] becomes "5". A ValueError names an id this process cannot see."""
    visible = visible_devices(environ)
    for gpu in gpu_ids:
        if gpu < 0 or (visible is not None and gpu >= len(visible)):
            seen = (
                f"CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)} GPUs"
                if visible is not None
                else ""
            )
            raise ValueError(
                f"GPU id {gpu} does not exist: ids are this process's logical GPUs (0..n-1)"
                + (f"; {seen}" if seen else "")
            )
    if visible is None:
        return ",".join(str(gpu) for gpu in gpu_ids)
    return ",".join(visible[gpu] for gpu in gpu_ids)


def check_gpu_ids(what: str, gpu_ids: list[int], count: int) -> None:
    """A clear ValueError, before anything loads, for an id outside the `count` GPUs this process sees."""
    missing = [gpu for gpu in gpu_ids if not 0 <= gpu < count]
    if missing:
        raise ValueError(
            f"{what} {missing} do not exist: this process sees {count} GPU(s), ids 0..{count - 1} "
            "(logical ids, counted inside CUDA_VISIBLE_DEVICES when it is set)"
        )


_SET_BY_IMPORTS: dict[str, str] = {}  # allocator settings a library's import wrote into os.environ


@contextlib.contextmanager
def noting_import_settings() -> Iterator[None]:
    """Around an import that writes allocator settings into os.environ (Unsloth sets PYTORCH_ALLOC_CONF for this
    process): remember them, so that `without_import_settings` keeps them out of child processes."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name, value in os.environ.items():
            if name.startswith("PYTORCH_") and before.get(name) != value:
                _SET_BY_IMPORTS[name] = value


def without_import_settings(env: dict[str, str]) -> dict[str, str]:
    """`env` less the settings an import wrote (a user's own value of the same name stays)."""
    return {name: value for name, value in env.items() if _SET_BY_IMPORTS.get(name) != value}
