"""Packing tensors into arena blocks and building typed views over blocks (torch side of the manifest)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .dtypes import dtype_name, parse_dtype
from .manifest import (
    DEFAULT_BLOCK_BYTES,
    ROLES,
    Manifest,
    TensorSpec,
    capture_block_bytes,
    extent_bytes,
    pack_sizes,
)


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
        end = start + extent_bytes(t.shape, t.stride(), item)
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
    storages, blocks = pack_sizes([end - start for _, start, end, _ in groups], block_bytes)
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


def pack_consuming(manifest: Manifest, spans, device: torch.device, blocks: list, progress, on_block) -> int:
    """Copy the planned storages into arena blocks allocated one at a time (appended to ``blocks``), freeing
    each source storage once its bytes are in its block; returns the bytes that could not be freed. On an
    error every block made is closed and ``blocks`` emptied."""
    from .arena import allocate_block

    by_block: list[list[int]] = [[] for _ in manifest.blocks]
    for i, spec in enumerate(manifest.storages):
        by_block[spec.block].append(i)
    kept = 0
    try:
        for bi, members in enumerate(by_block):
            block = allocate_block(manifest.blocks[bi].nbytes, device)
            blocks.append(block)
            on_block()
            for i in members:
                spec, (t, start, end) = manifest.storages[i], spans[i]
                block.tensor[spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
                progress(end - start)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for i in members:
                kept += release_storage(spans[i][0])
            if device.type == "cuda":
                torch.cuda.empty_cache()  # hand the freed memory back to the driver for the next block
    except BaseException:
        for b in blocks:
            b.close()
        blocks.clear()
        raise
    return kept
