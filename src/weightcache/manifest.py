"""What lives where in an arena: tensor specs, storage packing and building views over blocks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated

import msgspec
import torch

from .key import dtype_name, parse_dtype

ALIGNMENT = 256
DEFAULT_BLOCK_BYTES = 16 << 30  # fewer handles to import: 64 GB attached 11.8 vs 13.0 ms with 4 GiB
ROLES = ("parameter", "buffer", "nonpersistent_buffer", "attribute")


class TensorMeta(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    role: str = "parameter"


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Dims = Annotated[list[NonNegative], msgspec.Meta(max_length=64)]


# Specs travel as msgpack arrays (compact, fast to decode) and hold no cycles (gc=False: nothing for the
# collector to track when a client decodes thousands of them). Decoding already refuses negative numbers.
class TensorSpec(msgspec.Struct, frozen=True, array_like=True, gc=False):
    name: str
    dtype: str
    shape: Dims
    stride: Dims
    storage: NonNegative
    byte_offset: NonNegative  # of element [0, ..., 0] from the start of its storage span
    role: str = "parameter"


class StorageSpec(msgspec.Struct, frozen=True, array_like=True, gc=False):
    block: NonNegative
    offset: NonNegative
    nbytes: NonNegative


class BlockSpec(msgspec.Struct, array_like=True, gc=False):
    nbytes: NonNegative


class Manifest(msgspec.Struct):
    tensors: list[TensorSpec]
    storages: list[StorageSpec]
    blocks: list[BlockSpec]
    device: str = "cpu"
    gpu_uuid: str = ""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def roles(self) -> dict[str, str]:
        return {t.name: t.role for t in self.tensors}


def _align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def _extent_bytes(shape, stride, itemsize: int) -> int:
    """Bytes spanned from element [0..0] to the last element (0 for empty tensors)."""
    last = 0
    for n, st in zip(shape, stride, strict=True):
        if n == 0:
            return 0
        last += (n - 1) * st
    return (last + 1) * itemsize


def _contiguous_stride(shape) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return stride[::-1]


def _pack(sizes: list[int], block_bytes: int) -> tuple[list[StorageSpec], list[BlockSpec]]:
    storages, blocks = [], []
    used = block_bytes  # forces a new block at the first storage
    for size in sizes:
        size = _align(max(size, 1))
        if size > block_bytes:
            blocks.append(BlockSpec(size))
            storages.append(StorageSpec(len(blocks) - 1, 0, size))
            used = block_bytes
            continue
        if used + size > block_bytes:
            blocks.append(BlockSpec(0))
            used = 0
        storages.append(StorageSpec(len(blocks) - 1, used, size))
        used += size
        blocks[-1].nbytes = used
    return storages, blocks


def plan_for_metas(metas: list[TensorMeta], block_bytes: int = DEFAULT_BLOCK_BYTES) -> Manifest:
    """Pack freshly produced (contiguous) tensors, one storage each."""
    _check_unique([m.name for m in metas])
    sizes, specs = [], []
    for i, m in enumerate(metas):
        if m.role not in ROLES:
            raise ValueError(f"{m.name}: unknown role {m.role!r}")
        dtype = parse_dtype(m.dtype)
        sizes.append(math.prod(m.shape) * dtype.itemsize)
        specs.append(TensorSpec(m.name, m.dtype, list(m.shape), _contiguous_stride(m.shape), i, 0, m.role))
    storages, blocks = _pack(sizes, block_bytes)
    return Manifest(specs, storages, blocks)


def _check_unique(names) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate tensor name {n!r}")
        seen.add(n)


def _storage_id(t: torch.Tensor):
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def storage_groups(tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, int, int, list[str]]]:
    """Group tensors by shared storage: (a member tensor, span start byte, span end byte, names)."""
    groups: dict = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"{name}: a meta tensor has no data to cache")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"{name}: only strided (dense) tensors can be cached, got {t.layout}")
        item = t.element_size()
        start = t.storage_offset() * item
        end = start + _extent_bytes(t.shape, t.stride(), item)
        if any(st < 0 for st in t.stride()):
            raise ValueError(f"{name}: negative strides are not supported")
        sid = _storage_id(t)
        g = groups.get(sid)
        if g is None:
            groups[sid] = [t, start, end, [name]]
        else:
            g[1], g[2] = min(g[1], start), max(g[2], end)
            g[3].append(name)
    return [tuple(g) for g in groups.values()]


def plan_for_tensors(
    tensors: Mapping[str, torch.Tensor],
    roles: Mapping[str, str] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    *,
    consume: bool = False,
) -> tuple[Manifest, list[tuple[torch.Tensor, int, int]]]:
    """Pack existing tensors; tensors sharing storage share bytes. Returns the manifest and, per storage,
    (member tensor, span start, span end) for copying the bytes in. ``consume``: the sources are freed
    block by block while packing, so blocks are sized by ``capture_block_bytes``."""
    roles = roles or {}
    groups = storage_groups(tensors)
    if consume:
        block_bytes = capture_block_bytes(sum(end - start for _, start, end, _ in groups), block_bytes)
    storages, blocks = _pack([end - start for _, start, end, _ in groups], block_bytes)
    index = {}
    for gi, (_, start, _, names) in enumerate(groups):
        for n in names:
            index[n] = (gi, start)
    specs = []
    for name, t in tensors.items():
        gi, span_start = index[name]
        role = roles.get(name, "parameter")
        if role not in ROLES:
            raise ValueError(f"{name}: unknown role {role!r}")
        specs.append(TensorSpec(
            name, dtype_name(t.dtype), list(t.shape), list(t.stride()), gi,
            t.storage_offset() * t.element_size() - span_start, role,
        ))
    return Manifest(specs, storages, blocks), [(g[0], g[1], g[2]) for g in groups]


def capture_block_bytes(total: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Block size when packing consumes its sources (``Daemon.load_tensors(release=True)``): about a
    sixteenth of the weights, so one block in flight adds at most ~6% to the peak, between 256 MiB and
    ``block_bytes``."""
    return min(block_bytes, max(_align(-(-total // 16), 2 << 20), 256 << 20))


def release_storage(t: torch.Tensor) -> int:
    """Free a tensor's storage now (every view of it becomes empty); returns the bytes that could not be
    freed (a storage torch cannot resize, e.g. one over memory it does not own)."""
    storage = t.untyped_storage()
    n = storage.nbytes()
    if not storage.resizable():
        return n
    storage.resize_(0)
    return 0


def storage_bytes(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """A flat uint8 view over bytes [start, end) of t's storage."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), start, (end - start,), (1,))
    return flat


def validate(manifest: Manifest) -> None:
    """Refuse a manifest whose specs point outside their blocks (never build a wild view)."""
    blocks, storages = manifest.blocks, manifest.storages
    for i, s in enumerate(storages):
        if not 0 <= s.block < len(blocks):
            raise ValueError(f"storage {i}: block {s.block} does not exist")
        if s.offset < 0 or s.nbytes < 0 or s.offset + s.nbytes > blocks[s.block].nbytes:
            raise ValueError(f"storage {i}: bytes [{s.offset}, {s.offset + s.nbytes}) outside its block")
    extents: dict[tuple, tuple[int, int]] = {}  # (dtype, shape, stride) -> (itemsize, extent): layers repeat
    names = set()
    nstorages = len(storages)
    for t in manifest.tensors:
        form = (t.dtype, *t.shape, None, *t.stride)
        known = extents.get(form)
        if known is None:
            shape, stride = t.shape, t.stride
            if len(shape) != len(stride) or (shape and (min(shape) < 0 or min(stride) < 0)):
                raise ValueError(f"{t.name}: bad shape/stride {shape}/{stride}")
            item = parse_dtype(t.dtype).itemsize
            known = extents[form] = (item, _extent_bytes(shape, stride, item))
        item, extent = known
        if not 0 <= t.storage < nstorages:
            raise ValueError(f"{t.name}: storage {t.storage} does not exist")
        if t.byte_offset < 0 or (storages[t.storage].offset + t.byte_offset) % item:
            raise ValueError(f"{t.name}: misaligned byte offset {t.byte_offset}")
        if t.byte_offset + extent > storages[t.storage].nbytes:
            raise ValueError(f"{t.name}: extends past its storage")
        names.add(t.name)
    if len(names) != len(manifest.tensors):
        _check_unique([t.name for t in manifest.tensors])


def build_views(manifest: Manifest, blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One typed view per tensor over 1-D uint8 block tensors; tensors sharing a storage share bytes.

    Tensors of one form (block, dtype, shape, stride) at evenly spaced offsets, such as the same weight of
    every layer, are made by one strided view and one unbind: a C++ loop instead of a Python call each."""
    if len(blocks) != len(manifest.blocks):
        raise ValueError(f"manifest has {len(manifest.blocks)} blocks, got {len(blocks)}")
    typed: dict[tuple[int, str], tuple[torch.Tensor, int, int]] = {}  # (block, dtype) -> alias, offset, item
    forms: dict[tuple, list[tuple[int, str]]] = {}
    storages = manifest.storages
    for t in manifest.tensors:
        s = storages[t.storage]
        alias = typed.get((s.block, t.dtype))
        if alias is None:
            dtype = parse_dtype(t.dtype)
            block = blocks[s.block]
            flat = block[:block.numel() - block.numel() % dtype.itemsize].view(dtype)
            alias = typed[(s.block, t.dtype)] = (flat, flat.storage_offset(), dtype.itemsize)
        start = alias[1] + (s.offset + t.byte_offset) // alias[2]
        forms.setdefault((s.block, t.dtype, *t.shape, None, *t.stride), []).append((start, t.name))
    made: dict[str, torch.Tensor] = {}
    for form, members in forms.items():
        flat = typed[(form[0], form[1])][0]
        cut = form.index(None)
        shape, stride = list(form[2:cut]), list(form[cut + 1:])
        members.sort()
        for run in _even_runs(members):
            first = run[0][0]
            if len(run) == 1:
                made[run[0][1]] = flat.as_strided(shape, stride, first)
                continue
            gap = run[1][0] - first
            stacked = flat.as_strided([len(run), *shape], [gap, *stride], first).unbind(0)
            for (_, name), view in zip(run, stacked, strict=True):
                made[name] = view
    return {t.name: made[t.name] for t in manifest.tensors}


def _even_runs(members: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split (offset, name) pairs sorted by offset into maximal runs of equal spacing."""
    runs, i, n = [], 0, len(members)
    while i < n:
        j = i + 1
        if j < n:
            gap = members[j][0] - members[i][0]
            while j + 1 < n and members[j + 1][0] - members[j][0] == gap:
                j += 1
            j += 1
        runs.append(members[i:j])
        i = j
    return runs
