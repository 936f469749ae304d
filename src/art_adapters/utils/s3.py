"""`art_adapters.utils.s3` (ART's path): a model folder synced with a bucket by project and name, without a backend
(ART's `pull_model_from_s3` / `push_model_to_s3`); the behaviour lives in `art_adapters.backend.s3`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..backend import s3
from ..backend.s3 import Excludable as ExcludableOption
from ..backend.s3 import S3Location, S3SyncError
from ..paths import get_output_dir_from_model_properties, get_step_checkpoint_dir


def build_s3_path(
    *,
    model_name: str,
    project: str,
    step: int | None = None,
    s3_bucket: str | None = None,
    prefix: str | None = None,
) -> str:
    """`s3://{bucket}/{prefix/}{project}/models/{name}` (and `/checkpoints/{step:04d}` with a step)."""
    uri = S3Location.of(project, model_name, s3_bucket, prefix).uri().rstrip("/")
    return uri if step is None else f"{uri}/checkpoints/{step:04d}"


def build_s3_zipped_step_path(
    *, model_name: str, project: str, step: int, s3_bucket: str | None = None, prefix: str | None = None
) -> str:
    location = S3Location.of(project, model_name, s3_bucket, prefix)
    return f"s3://{location.bucket}/{s3.zipped_step_key(location, step)}"


async def ensure_bucket_exists(s3_bucket: str | None = None, profile: str | None = None) -> None:
    """Create the bucket (`s3_bucket` or `BACKUP_BUCKET`) if it does not exist. `profile`: an AWS profile name,
    read as boto3 reads `AWS_PROFILE`."""
    if profile is not None:
        raise S3SyncError("ensure_bucket_exists(profile=): set AWS_PROFILE instead (boto3 reads it)")
    bucket = S3Location.of("p", "m", s3_bucket).bucket
    if await asyncio.to_thread(s3.ensure_bucket, bucket):
        print(f"S3 bucket {bucket} does not exist, created it")


async def pull_model_from_s3(
    model_name: str,
    project: str,
    step: int | None = None,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
    art_path: str | None = None,
    exclude: list[ExcludableOption] | None = None,
) -> str:
    """Download the model's folder (or one checkpoint) into `{art_path}/{project}/models/{name}`; returns it."""
    folder = get_output_dir_from_model_properties(project, model_name, art_path)
    location = S3Location.of(project, model_name, s3_bucket, prefix)
    received = await asyncio.to_thread(
        s3.pull, Path(folder), location, step=step, exclude=exclude, delete=delete
    )
    if verbose:
        print(f"pulled {len(received)} file(s) from {location.uri()} to {folder}")
    return folder


async def push_model_to_s3(
    model_name: str,
    project: str,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
    art_path: str | None = None,
) -> None:
    """Upload the model's folder (only what changed)."""
    folder = get_output_dir_from_model_properties(project, model_name, art_path)
    location = S3Location.of(project, model_name, s3_bucket, prefix)
    sent = await asyncio.to_thread(s3.push, Path(folder), location, delete=delete)
    if verbose:
        print(f"pushed {len(sent)} file(s) from {folder} to {location.uri()}")


async def archive_and_presign_step_url(
    model_name: str,
    project: str,
    step: int,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
    art_path: str | None = None,
    checkpoint_path: str | None = None,
) -> str:
    """Zip a step's checkpoint to the bucket and return a presigned URL to it, valid one hour."""
    if checkpoint_path is None:
        folder = get_output_dir_from_model_properties(project, model_name, art_path)
        checkpoint_path = get_step_checkpoint_dir(folder, step)
    location = S3Location.of(project, model_name, s3_bucket, prefix)
    url = await asyncio.to_thread(s3.presigned_step_archive, location, Path(checkpoint_path), step)
    if verbose:
        print(
            f"archived step {step:04d} to {build_s3_zipped_step_path(model_name=model_name, project=project, step=step, s3_bucket=location.bucket, prefix=prefix)}"
        )
    return url


__all__ = [
    "ExcludableOption",
    "S3SyncError",
    "archive_and_presign_step_url",
    "build_s3_path",
    "build_s3_zipped_step_path",
    "ensure_bucket_exists",
    "pull_model_from_s3",
    "push_model_to_s3",
]
