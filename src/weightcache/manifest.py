"""What lives where in an arena: tensor specs, storage packing and building views over blocks."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from .dtypes import itemsize

ALIGNMENT = 256
DEFAULT_BLOCK_BYTES = 16 << 30  # few handles to import per attach (docs/benchmarks.md)
DIGEST_CHUNK_MIN = 16  # digest chunks are whole 16-byte units (integrity/algorithm.py)
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
    digests: bytes = b""  # one little-endian 64-bit digest per chunk (Manifest.integrity); empty: none


class Manifest(msgspec.Struct):
    tensors: list[TensorSpec]
    storages: list[StorageSpec]
    blocks: list[BlockSpec]
    device: str = "cpu"
    gpu_uuid: str = ""
    integrity: str = ""  # the algorithm of the blocks' digests; "": none recorded
    chunk_bytes: int = 0  # the digests' chunk size

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def roles(self) -> dict[str, str]:
        return {t.name: t.role for t in self.tensors}


def align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def extent_bytes(shape, stride, itemsize: int) -> int:
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


def pack_sizes(sizes: list[int], block_bytes: int) -> tuple[list[StorageSpec], list[BlockSpec]]:
    storages, blocks = [], []
    used = block_bytes  # forces a new block at the first storage
    for size in sizes:
        size = align(max(size, 1))
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
    check_unique([m.name for m in metas])
    sizes, specs = [], []
    for i, m in enumerate(metas):
        if m.role not in ROLES:
            raise ValueError(f"{m.name}: unknown role {m.role!r}")
        item = itemsize(m.dtype)
        sizes.append(math.prod(m.shape) * item)
        specs.append(TensorSpec(m.name, m.dtype, list(m.shape), _contiguous_stride(m.shape), i, 0, m.role))
    storages, blocks = pack_sizes(sizes, block_bytes)
    return Manifest(specs, storages, blocks)


def check_unique(names) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate tensor name {n!r}")
        seen.add(n)


def capture_block_bytes(total: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Block size when packing consumes its sources (``Daemon.load_tensors(release=True)``): about a
    sixteenth of the weights, so one block in flight adds at most ~6% to the peak, between 256 MiB and
    ``block_bytes``."""
    return min(block_bytes, max(align(-(-total // 16), 2 << 20), 256 << 20))


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
            item = itemsize(t.dtype)
            known = extents[form] = (item, extent_bytes(shape, stride, item))
        item, extent = known
        if not 0 <= t.storage < nstorages:
            raise ValueError(f"{t.name}: storage {t.storage} does not exist")
        if t.byte_offset < 0 or (storages[t.storage].offset + t.byte_offset) % item:
            raise ValueError(f"{t.name}: misaligned byte offset {t.byte_offset}")
        if t.byte_offset + extent > storages[t.storage].nbytes:
            raise ValueError(f"{t.name}: extends past its storage")
        names.add(t.name)
    if len(names) != len(manifest.tensors):
        check_unique([t.name for t in manifest.tensors])
    validate_digests(manifest)


def validate_digests(manifest: Manifest) -> None:
    """Refuse digests that do not cover their blocks chunk for chunk."""
    if not manifest.integrity:
        if any(b.digests for b in manifest.blocks):
            raise ValueError("blocks carry digests but the manifest names no digest algorithm")
        return
    chunk = manifest.chunk_bytes
    if not isinstance(chunk, int) or chunk < DIGEST_CHUNK_MIN or chunk % DIGEST_CHUNK_MIN:
        raise ValueError(f"digest chunk size {chunk!r} is not a positive multiple of {DIGEST_CHUNK_MIN}")
    for i, b in enumerate(manifest.blocks):
        want = 8 * -(-b.nbytes // chunk)
        if len(b.digests) != want:
            raise ValueError(f"block {i}: {len(b.digests)} bytes of digests, its {b.nbytes} bytes in chunks of "
                             f"{chunk} need {want}")


