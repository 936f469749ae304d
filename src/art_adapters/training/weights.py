"""Reading a Hugging Face checkpoint one tensor at a time (safetensors, single file or sharded with an index), with
plain reads: no memory map, so the reader's resident memory is one tensor, whatever the model's size."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (ValueError naming the folder when it has none)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{folder} has no safetensors weights (model.safetensors or an index): the sharded trainer loads only those"
    )


def _header(path: Path) -> tuple[int, dict[str, dict]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


class CheckpointReader:
    """`read(name)`: one tensor of the checkpoint, read from disk when asked."""

    def __init__(self, folder: str | Path) -> None:
        self.entries: dict[str, tuple[Path, int, dict]] = {}
        for path in checkpoint_files(Path(folder)):
            start, header = _header(path)
            for name, entry in header.items():
                self.entries[name] = (path, start, entry)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> torch.Tensor:
        path, start, entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(
                f"{path.name}: tensor {name} has dtype {entry['dtype']}, which the loader does not read"
            )
        buffer = bytearray(end - begin)
        with path.open("rb") as f:
            f.seek(start + begin)
            if f.readinto(buffer) != len(buffer):
                raise ValueError(f"{path.name} is truncated (tensor {name})")
        if not buffer:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry["shape"])


FINGERPRINT_SAMPLES = 64  # chunks sampled from each weights file, the last one ending the file
FINGERPRINT_CHUNK = 1 << 16


def weights_fingerprint(folder: str | Path) -> str:
    """A cheap fingerprint of a checkpoint's weights: each file's size, header, first MiB of data and
    FINGERPRINT_SAMPLES chunks spread evenly over the rest (two hosts with different weights of the same
    architecture differ here, even in a late tensor; reading every byte would take minutes)."""
    digest = hashlib.sha256()
    for path in checkpoint_files(Path(folder)):
        start, _ = _header(path)
        size = path.stat().st_size
        digest.update(str(size).encode())
        with path.open("rb") as f:
            digest.update(f.read(start + (1 << 20)))
            rest = max(size - FINGERPRINT_CHUNK, 0)
            for i in range(FINGERPRINT_SAMPLES + 1):
                f.seek(rest * i // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()
