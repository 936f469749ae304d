"""ART's checkpoint sync calls on LocalBackend: `_experimental_pull_from_s3`, `_experimental_push_to_s3`,
`_experimental_pull_model_checkpoint`, `_experimental_fork_checkpoint` (ART's names and arguments, on `s3.py`).

A model already registered picks up a newer checkpoint that arrives: its trainer resumes from it and it becomes the
served version, so ART's pattern (register, then pull) trains on from where the bucket left off."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from . import s3
from .s3 import Excludable, S3Location, S3SyncError

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

log = logging.getLogger("art_adapters.backend.local")


class _Host(Protocol):
    def model_dir(self, model: Model) -> Path: ...

    async def resume_from_disk(self, model: Model) -> None: ...


class CheckpointSync:
    """Mixed into LocalBackend, which provides `model_dir` and `resume_from_disk` (`_Host`)."""

    async def _experimental_push_to_s3(
        self: _Host,
        model: Model,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """Upload the model's folder (only what changed) to `s3://{bucket}/{prefix}/{project}/models/{name}/`."""
        location = S3Location.of(model.project, model.name, s3_bucket, prefix)
        sent = await asyncio.to_thread(s3.push, self.model_dir(model), location, delete=delete)
        _report(verbose, f"pushed {len(sent)} file(s) to {location.uri()}")

    async def _experimental_pull_from_s3(
        self: _Host,
        model: Model,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        only_step: int | Literal["latest"] | None = None,
        step: int | None = None,
        exclude: list[Excludable] | None = None,
        latest_only: bool = False,
    ) -> None:
        """Download the model's folder from the bucket (only what changed; `only_step` one checkpoint, "latest"
        the newest; `exclude` checkpoints, logs or trajectories). A registered model resumes from what arrived."""
        location = S3Location.of(model.project, model.name, s3_bucket, prefix)
        wanted: int | Literal["latest"] | None = step if step is not None else only_step
        if wanted is None and latest_only:
            wanted = "latest"
        if wanted == "latest":
            steps = await asyncio.to_thread(lambda: s3.remote_steps(s3.remote_files(s3.client(), location)))
            if not steps:
                _report(verbose, f"no checkpoint at {location.uri()}")
                return
            wanted = steps[-1]
        received = await asyncio.to_thread(
            s3.pull, self.model_dir(model), location, step=wanted, exclude=exclude, delete=delete
        )
        _report(
            verbose,
            f"pulled {len(received)} file(s) from {location.uri()}"
            if received
            else f"nothing new at {location.uri()}",
        )
        await self.resume_from_disk(model)

    async def _experimental_pull_model_checkpoint(
        self: _Host,
        model: TrainableModel,
        *,
        step: int | Literal["latest"] | None = None,
        local_path: str | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
    ) -> str:
        """A checkpoint's local folder: the one asked for, or the newest here or (with a bucket) there, fetched
        when it is not here; copied to `local_path` if given."""
        from .. import checkpoints

        directory = self.model_dir(model)
        local = checkpoints.list_steps(directory)
        remote: list[int] = []
        location = S3Location.of(model.project, model.name, s3_bucket, prefix) if s3_bucket else None
        if location is not None:
            remote = await asyncio.to_thread(lambda: s3.remote_steps(s3.remote_files(s3.client(), location)))
        if step is None or step == "latest":
            candidates = local + remote
            if not candidates:
                raise FileNotFoundError(
                    f"no checkpoint of {model.project}/{model.name} here or in the bucket"
                )
            step = max(candidates)
        if step not in local:
            if location is None or step not in remote:
                raise FileNotFoundError(f"checkpoint {step:04d} of {model.project}/{model.name} is not here")
            await asyncio.to_thread(s3.pull, directory, location, step=step)
        path = checkpoints.checkpoint_dir(directory, step)
        if local_path is not None:
            target = Path(local_path)
            await asyncio.to_thread(shutil.copytree, path, target, dirs_exist_ok=True)
            path = target
        _report(verbose, f"checkpoint {step:04d} at {path}")
        return str(path)

    async def _experimental_fork_checkpoint(
        self: _Host,
        model: Model,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> None:
        """Start `model` from another model's checkpoint (the newest, or the newest not after `not_after_step`),
        here or in a bucket; it keeps its step number."""
        from .. import checkpoints
        from ..model import Model as PlainModel

        source = PlainModel(name=from_model, project=from_project or model.project)
        source_dir = self.model_dir(source)
        if from_s3_bucket is not None:
            location = S3Location.of(source.project, source.name, from_s3_bucket, prefix)
            steps = await asyncio.to_thread(lambda: s3.remote_steps(s3.remote_files(s3.client(), location)))
            chosen = _not_after(steps, not_after_step, f"{location.uri()}")
            await asyncio.to_thread(s3.pull, source_dir, location, step=chosen)
        chosen = _not_after(checkpoints.list_steps(source_dir), not_after_step, str(source_dir))
        target = checkpoints.checkpoint_dir(self.model_dir(model), chosen)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(
            shutil.copytree, checkpoints.checkpoint_dir(source_dir, chosen), target, dirs_exist_ok=True
        )
        _report(verbose, f"forked {source.project}/{source.name} checkpoint {chosen:04d} into {target}")
        await self.resume_from_disk(model)


def _not_after(steps: list[int], bound: int | None, where: str) -> int:
    valid = [s for s in steps if bound is None or s <= bound]
    if not valid:
        after = "" if bound is None else f" not after step {bound}"
        raise FileNotFoundError(f"no checkpoint{after} at {where}")
    return valid[-1]


def _report(verbose: bool, message: str) -> None:
    if verbose:
        print(message)
    log.info(message)


__all__ = ["CheckpointSync", "S3SyncError"]
