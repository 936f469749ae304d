"""A model folder and an S3-compatible bucket (AWS, MinIO, R2, ...) kept in sync, in ART's layout.

`s3://{bucket}/{prefix}/{project}/models/{name}/...` mirrors `{backend path}/{project}/models/{name}/...`
(`checkpoints/{step:04d}/`, `history.jsonl`, `trajectories/`, `logs/`), so a bucket ART wrote restores here and one
written here restores in ART. Only files whose size or content differ are copied. A checkpoint is uploaded with
its adapter config last and downloaded into a hidden folder renamed into place once whole, so neither side ever
takes a partial checkpoint for one: a remote checkpoint counts only with its adapter config and weights.
The bucket comes from the call or `BACKUP_BUCKET`; credentials and endpoint from the standard AWS variables
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_REGION`), as boto3 reads them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..untrusted import parse_step, relative_key_problem

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
COMPLETE = ("adapter_config.json", "adapter_model.safetensors")  # a checkpoint exists once both do
LAST = "adapter_config.json"  # uploaded last: its presence says the rest arrived
FOLDERS = ("checkpoints", "logs", "trajectories")  # the model folder's own folders: never a file of that name
FILES = ("history.jsonl",)  # and its own files: never a folder of that name
NAME_MAX = 255  # bytes in one file or folder name (ext4, XFS, APFS, NTFS...)
Excludable = Literal["checkpoints", "logs", "trajectories"]


class S3SyncError(RuntimeError):
    """A sync that cannot run (no bucket, no credentials, an unreachable store); the message says which."""


@dataclass(frozen=True)
class S3Location:
    """Where a model's folder lives in a bucket."""

    bucket: str
    prefix: str  # `{prefix/}{project}/models/{name}/`, always ending with "/"

    @classmethod
    def of(cls, project: str, name: str, bucket: str | None = None, prefix: str | None = None) -> S3Location:
        bucket = bucket or os.environ.get("BACKUP_BUCKET")
        if not bucket:
            raise S3SyncError("no S3 bucket: pass s3_bucket=... or set BACKUP_BUCKET")
        lead = f"{prefix.strip('/')}/" if prefix and prefix.strip("/") else ""
        return cls(bucket=bucket, prefix=f"{lead}{project}/models/{name}/")

    def uri(self, relative: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{relative}"


def client() -> Any:
    """A boto3 S3 client configured by the standard AWS variables (`AWS_ENDPOINT_URL` for MinIO, R2, ...)."""
    try:
        import boto3
    except ImportError as error:
        raise S3SyncError("S3 sync needs boto3: pip install 'art-adapters[s3]'") from error
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint
    )  # a fresh session reads the variables now


def remote_files(s3: Any, location: S3Location) -> dict[str, dict[str, Any]]:
    """Every object under the model's folder that may become a local file: relative path -> its size and ETag.
    A key with an empty, `.` or `..` segment (`../../x`, an absolute tail after `//`), a name longer than a file
    system takes, or a path the model folder's own layout needs otherwise (a file `checkpoints`, a folder
    `history.jsonl`; a name that is both a file and a folder in the bucket: the file stands) is left out, with a
    warning naming it and why: a shared bucket never writes outside the model's folder, and one bad key breaks no
    pull."""
    files: dict[str, dict[str, Any]] = {}
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=location.prefix
        ):
            for item in page.get("Contents", []):
                relative = item["Key"][len(location.prefix) :]
                problem = relative_key_problem(relative) or layout_problem(relative)
                if problem is not None:
                    if not (relative.endswith("/") and item["Size"] == 0):  # a console "folder" is no file
                        log.warning("S3 object %r refused: %s", item["Key"], problem)
                    continue
                files[relative] = {"size": item["Size"], "etag": item["ETag"].strip('"')}
    except Exception as error:
        raise _clear(error, location) from error
    for relative in sorted(files):
        parts = relative.split("/")
        through = next(
            ("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in files), None
        )
        if through is not None:
            log.warning(
                "S3 object %r refused: its path runs through %r, which is a file in the bucket",
                location.prefix + relative,
                location.prefix + through,
            )
            del files[relative]
    return files


def layout_problem(relative: str) -> str | None:
    """Why a key (relative to a model's folder, its segments already checked) cannot be a local file of it, or
    None: a name longer than file systems take, or a path where the folder's own layout needs something else."""
    parts = relative.split("/")
    for part in parts:
        try:
            size = len(os.fsencode(part))
        except UnicodeEncodeError:
            return "a name the local file system cannot encode"
        if size > NAME_MAX:
            return f"a name of {size} bytes (file systems take at most {NAME_MAX})"
    if len(parts) == 1 and parts[0] in FOLDERS:
        return f"a file where the model folder's {parts[0]}/ folder must be"
    if len(parts) > 1 and parts[0] in FILES:
        return f"a path through {parts[0]}, which is the model folder's own file"
    if len(parts) == 2 and parts[0] == CHECKPOINTS and parse_step(parts[1]) is not None:
        return f"a file where checkpoint {parts[1]}'s folder must be"
    return None


def checkpoint_step(relative: str) -> int | None:
    """The step of a file inside `checkpoints/{step}/` (ASCII digits only), or None."""
    parts = relative.split("/")
    if len(parts) < 3 or parts[0] != CHECKPOINTS:
        return None
    return parse_step(parts[1])


def remote_steps(files: dict[str, dict[str, Any]]) -> list[int]:
    """The complete checkpoints in a listing (adapter config and weights both there)."""
    present: dict[int, set[str]] = {}
    for relative in files:
        step = checkpoint_step(relative)
        if step is not None and relative.count("/") == 2:
            present.setdefault(step, set()).add(relative.rsplit("/", 1)[1])
    return sorted(step for step, names in present.items() if set(COMPLETE) <= names)


def local_destination(model_dir: Path, relative: str) -> Path:
    """Where the object `relative` lands: inside the model's folder once every link is resolved, or S3SyncError."""
    problem = relative_key_problem(relative)
    if problem is not None:
        raise S3SyncError(f"S3 object {relative!r} refused: {problem}")
    root = model_dir.resolve()
    destination = (root / relative).resolve()
    if not destination.is_relative_to(root):
        raise S3SyncError(
            f"S3 object {relative!r} would be written outside the model folder {root} (to {destination}, "
            "through a link): refused"
        )
    return destination


def push(
    model_dir: Path, location: S3Location, *, delete: bool = False, exclude: list[Excludable] | None = None
) -> list[str]:
    """Upload what differs from the bucket (never a checkpoint still being written here); returns the paths sent.
    `delete`: also remove objects the local folder no longer has."""
    if not model_dir.is_dir():
        raise S3SyncError(f"no local model folder to push: {model_dir}")
    s3 = client()
    remote = remote_files(s3, location)
    local = _local_files(model_dir, exclude)
    # a checkpoint's adapter config goes last, so a reader never sees a checkpoint whose weights are missing
    order = sorted(local, key=lambda p: (p.endswith("/" + LAST), p))
    sent = []
    try:
        for relative in order:
            path = model_dir / relative
            if not _same(path, remote.get(relative)):
                s3.upload_file(str(path), location.bucket, location.prefix + relative)
                sent.append(relative)
        if delete:
            for relative in sorted(set(remote) - set(local)):
                if not _excluded(relative, exclude):
                    s3.delete_object(Bucket=location.bucket, Key=location.prefix + relative)
    except Exception as error:
        raise _clear(error, location) from error
    return sent


def pull(
    model_dir: Path,
    location: S3Location,
    *,
    step: int | None = None,
    exclude: list[Excludable] | None = None,
    delete: bool = False,
) -> list[str]:
    """Download what differs locally: every file (or, with `step`, that one checkpoint). A checkpoint lands whole
    or not at all; an incomplete one in the bucket is skipped. A file or checkpoint whose local place cannot take
    it (a folder or file already in the way) is skipped with a warning, nothing of it left behind; a store that
    fails raises S3SyncError. Returns the paths received."""
    s3 = client()
    remote = remote_files(s3, location)
    if not remote and step is None:
        return []  # a first run: nothing saved yet (ART's examples pull before their first step)
    complete = set(remote_steps(remote))
    if step is not None and step not in complete:
        raise S3SyncError(f"no complete checkpoint {step:04d} at {location.uri(CHECKPOINTS)}")
    wanted: dict[str, list[str]] = {}  # folder (a checkpoint, or "" for loose files) -> its files
    for relative in remote:
        if _excluded(relative, exclude):
            continue
        parts = relative.split("/")
        at = checkpoint_step(relative)
        if step is not None and at != step:
            continue
        if at is not None:
            if at in complete:
                wanted.setdefault(f"{CHECKPOINTS}/{parts[1]}", []).append(relative)
        elif not (parts[0] == CHECKPOINTS and len(parts) >= 3):  # not a step: no file of a checkpoint
            wanted.setdefault("", []).append(relative)
    received: list[str] = []
    model_dir.mkdir(parents=True, exist_ok=True)
    for files in wanted.values():
        for relative in files:
            local_destination(model_dir, relative)  # every destination checked before anything is written
    for folder, files in wanted.items():
        changed = [r for r in files if not _same(model_dir / r, remote[r])]
        if not changed:
            continue
        if folder:  # a checkpoint: fetched beside its place, then renamed in whole
            try:
                received += _pull_checkpoint(s3, location, model_dir, folder, files, remote)
            except OSError as error:
                log.warning("S3 checkpoint %r skipped: %s", location.uri(folder), _local_failure(error))
        else:
            for relative in changed:
                try:
                    _download(s3, location, relative, local_destination(model_dir, relative))
                except OSError as error:
                    log.warning("S3 object %r skipped: %s", location.uri(relative), _local_failure(error))
                    continue
                received.append(relative)
    if delete and step is None:
        local = _local_files(model_dir, exclude)
        for relative in sorted(set(local) - set(remote)):
            (model_dir / relative).unlink()
    return received


def zipped_step_key(location: S3Location, step: int) -> str:
    return f"{location.prefix}zipped-steps/{step:04d}.zip"


def presigned_step_archive(
    location: S3Location, checkpoint_path: Path, step: int, expires_s: int = 3600
) -> str:
    """Zip a checkpoint's serving files (not the optimizer's or trainer's state) to `zipped-steps/{step:04d}.zip`
    beside the model's files (ART's place) and return a presigned URL to it (what Together fetches an adapter
    from)."""
    from ..checkpoints import serving_files

    if not checkpoint_path.is_dir():
        raise S3SyncError(f"no checkpoint folder to archive: {checkpoint_path}")
    s3 = client()
    key = zipped_step_key(location, step)
    with tempfile.TemporaryDirectory() as folder:
        archive = Path(folder) / "checkpoint.zip"
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zipped:
            for path in serving_files(checkpoint_path):
                zipped.write(path, path.relative_to(checkpoint_path).as_posix())
        try:
            s3.upload_file(str(archive), location.bucket, key)
            return str(
                s3.generate_presigned_url(
                    "get_object", Params={"Bucket": location.bucket, "Key": key}, ExpiresIn=expires_s
                )
            )
        except Exception as error:
            raise _clear(error, location) from error


def ensure_bucket(bucket: str) -> bool:
    """Create the bucket when it does not exist (ART's `ensure_bucket_exists`); True when it was created."""
    s3 = client()
    location = S3Location(bucket=bucket, prefix="")
    try:
        s3.head_bucket(Bucket=bucket)
        return False
    except Exception as error:
        if str(getattr(error, "response", {}).get("Error", {}).get("Code", "")) not in (
            "404",
            "NoSuchBucket",
        ):
            raise _clear(error, location) from error
    try:
        s3.create_bucket(Bucket=bucket)
    except Exception as error:
        raise _clear(error, location) from error
    return True


def _pull_checkpoint(
    s3: Any, location: S3Location, model_dir: Path, folder: str, files: list[str], remote: dict[str, Any]
) -> list[str]:
    target = local_destination(model_dir, folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-pull-", dir=target.parent))
    try:
        for relative in files:
            name = relative[len(folder) + 1 :]
            existing = target / name
            if _same(existing, remote[relative]):
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(existing, staging / name)
            else:
                _download(s3, location, relative, staging / name)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files


def _download(s3: Any, location: S3Location, relative: str, destination: Path) -> None:
    """The object into a hidden short-named file beside `destination`, renamed onto it once whole. A local place
    that cannot take it raises OSError, a store that fails S3SyncError; either way no partial file stays."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=destination.parent)
    os.close(handle)
    partial = Path(name)
    try:
        try:
            s3.download_file(location.bucket, location.prefix + relative, str(partial))
        except Exception as error:
            raise _clear(error, location) from error
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)


def _local_failure(error: OSError) -> str:
    where = f": {error.filename}" if error.filename else ""
    return f"its local place cannot take it ({error.strerror or type(error).__name__}{where})"


def _local_files(model_dir: Path, exclude: list[Excludable] | None) -> dict[str, Path]:
    """Files of the model folder, relative, without anything being written (`.tmp-*` folders, `*.part`)."""
    out: dict[str, Path] = {}
    for path in model_dir.rglob("*"):
        relative = path.relative_to(model_dir).as_posix()
        if not path.is_file() or any(p.startswith((".tmp", ".")) for p in relative.split("/")):
            continue
        if not _excluded(relative, exclude):
            out[relative] = path
    return out


def _excluded(relative: str, exclude: list[Excludable] | None) -> bool:
    return bool(exclude) and relative.split("/", 1)[0] in (exclude or [])


def _same(path: Path, remote: dict[str, Any] | None) -> bool:
    """Whether a local file already holds the remote object (size, then content when the ETag is an MD5)."""
    if remote is None or not path.is_file() or path.stat().st_size != remote["size"]:
        return False
    etag = remote["etag"]
    return "-" in etag or _md5(path) == etag  # a multipart ETag is no MD5: equal sizes stand


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _clear(error: Exception, location: S3Location) -> S3SyncError:
    """One clear message for the failures a user can fix (no bucket, no or wrong credentials, no endpoint)."""
    name = type(error).__name__
    code = str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
    if name in ("NoCredentialsError", "PartialCredentialsError") or code in (
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
    ):
        return S3SyncError(
            f"S3 credentials missing or refused for bucket {location.bucket!r}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for MinIO, R2 and other S3-compatible stores)"
        )
    if code in ("NoSuchBucket", "404"):
        return S3SyncError(f"S3 bucket {location.bucket!r} does not exist (create it, or set BACKUP_BUCKET)")
    if code in ("AccessDenied", "403"):
        return S3SyncError(f"S3 access denied to {location.uri()}: check the credentials' permissions")
    if name in ("EndpointConnectionError", "ConnectTimeoutError"):
        return S3SyncError(f"S3 endpoint unreachable ({error}); is AWS_ENDPOINT_URL right?")
    return S3SyncError(f"S3 sync of {location.uri()} failed: {name}: {error}")
