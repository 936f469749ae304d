"""`art_adapters.utils.s3_checkpoint_utils` (ART's path): which checkpoints a bucket holds, without downloading."""

from __future__ import annotations

import asyncio

from ..backend import s3
from ..backend.s3 import S3Location


async def _steps(model_name: str, project: str, s3_bucket: str | None, prefix: str | None) -> list[int]:
    location = S3Location.of(project, model_name, s3_bucket, prefix)
    return await asyncio.to_thread(lambda: s3.remote_steps(s3.remote_files(s3.client(), location)))


async def get_latest_checkpoint_step_from_s3(
    model_name: str, project: str, s3_bucket: str | None = None, prefix: str | None = None
) -> int | None:
    """The newest complete checkpoint's step in the bucket, or None."""
    steps = await _steps(model_name, project, s3_bucket, prefix)
    return steps[-1] if steps else None


async def get_checkpoint_step_not_after_from_s3(
    model_name: str,
    project: str,
    not_after_step: int,
    s3_bucket: str | None = None,
    prefix: str | None = None,
) -> int | None:
    """The newest complete checkpoint's step at or before `not_after_step`, or None."""
    steps = [s for s in await _steps(model_name, project, s3_bucket, prefix) if s <= not_after_step]
    return steps[-1] if steps else None


__all__ = ["get_checkpoint_step_not_after_from_s3", "get_latest_checkpoint_step_from_s3"]
