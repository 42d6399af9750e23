"""Safetensors files: headers (tensor entries with absolute offsets) and a checkpoint's index."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dtypes import from_safetensors
from .reading import CheckpointError

MAX_HEADER_BYTES = 100 << 20
INDEX_NAME = "model.safetensors.index.json"

_DTYPES: dict = {}  # safetensors code -> torch.dtype, filled on first use


def torch_dtype(code: str, file: Path, name: str) -> torch.dtype:
    dt = _DTYPES.get(code)
    if dt is None:
        dt = from_safetensors(code)
        if dt is None:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {code!r}, which this torch cannot hold")
        _DTYPES[code] = dt
    return dt


@dataclass(frozen=True)
class CheckpointEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, CheckpointEntry], dict[str, str]]:
    """Parse a safetensors header: tensor entries with absolute offsets, and the metadata dict."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file or truncated (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries = {}
    dtypes = _DTYPES
    for name, info in header.items():
        try:
            code, shape, (b, e) = info["dtype"], tuple(map(int, info["shape"])), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from err
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has a negative dimension in its shape {list(shape)}")
        dtype = dtypes.get(code) or torch_dtype(code, path, name)
        expect = math.prod(shape) * dtype.itemsize
        if e - b != expect or b < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} occupies {e - b} bytes but shape {list(shape)} of {code} needs {expect}"
            )
        if base + e > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {base + e} but the file has {size} bytes (truncated?)"
            )
        entries[name] = CheckpointEntry(name, path, dtype, shape, base + b, e - b)
    _check_disjoint(path, entries)
    return entries, meta


def _check_disjoint(path: Path, entries: dict[str, CheckpointEntry]) -> None:
    """No two tensors may share bytes: one write would change both (safetensors' own loader refuses it too)."""
    last: CheckpointEntry | None = None
    for ent in sorted((x for x in entries.values() if x.nbytes), key=lambda x: x.start):
        if last is not None and ent.start < last.start + last.nbytes:
            raise CheckpointError(
                f"{path}: tensors {last.name!r} (bytes {last.start}..{last.start + last.nbytes}) and {ent.name!r} "
                f"(bytes {ent.start}..{ent.start + ent.nbytes}) overlap"
            )
        if last is None or ent.start + ent.nbytes > last.start + last.nbytes:
            last = ent


def checkpoint_entries(model_dir: str | Path) -> tuple[Path, dict[str, CheckpointEntry]]:
    """All tensors of a checkpoint (a .safetensors file, or a directory with or without an index)."""
    path = Path(model_dir)
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise CheckpointError(f"{path} is not a .safetensors file")
        return path, read_header(path)[0]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    index = path / INDEX_NAME
    if not index.is_file():
        others = sorted(path.glob("*.safetensors.index.json"))
        index = others[0] if len(others) == 1 else index
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from e
        entries: dict[str, CheckpointEntry] = {}
        headers: dict[str, dict[str, CheckpointEntry]] = {}
        for fname in sorted(set(weight_map.values())):
            f = path / fname
            if not f.is_file():
                names = [n for n, v in weight_map.items() if v == fname]
                raise CheckpointError(
                    f"{index} maps {len(names)} tensor(s) (e.g. {names[0]!r}) to {fname}, which is missing "
                    f"from {path}"
                )
            headers[fname] = read_header(f)[0]
        for name, fname in weight_map.items():
            if name not in headers[fname]:
                raise CheckpointError(f"{index} maps tensor {name!r} to {fname}, but that file lacks it")
            entries[name] = headers[fname][name]
        return path, entries
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {path}")
    entries = {}
    for f in files:
        for name, ent in read_header(f)[0].items():
            if name in entries:
                raise CheckpointError(
                    f"tensor {name!r} is in both {entries[name].file.name} and {f.name} in {path}, "
                    f"and there is no {INDEX_NAME} to say which one counts"
                )
            entries[name] = ent
    return path, entries
