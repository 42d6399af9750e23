"""A daemon group (one role on this node) and the keys its daemons derive and every node must agree on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from ..key import CacheKey
from .layout import Layout, Placement


@dataclass
class Group:
    """One daemon group (role) on this node: its layout and how each daemon gets its weights.

    Both callables run in the daemon process and must be module-level functions (spawn pickles them by
    reference): `make_source(placement, **source_args)` returns a Source, and
    `make_key(source, placement, layout=..., role=..., **key_args)` its CacheKey (default: the source's
    key_fields() over `key_args`, see `default_key`).
    """

    role: str
    layout: Layout
    make_source: Callable
    source_args: dict = field(default_factory=dict)
    make_key: Callable | None = None
    key_args: dict = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (single node only)
    info: dict = field(default_factory=dict)
    loads_alone: bool = True  # a rank's source loads without its peers (False: vLLM's loader with a process group)
    gpu_uuids: dict = field(default_factory=dict)  # rank -> its GPU's UUID, where known ahead (no torch needed)
    preimport: tuple = ()  # modules a load needs: the daemons import them while they wait to load


def default_key(source, placement: Placement, *, layout: str, role: str, **base) -> CacheKey:
    """The source's key_fields() over `base`; fields CacheKey has no slot for go to `extra`."""
    return make_key(source.key_fields(), base=base, layout=layout, rank=placement.rank, role=role)


def make_key(fields: dict, *, base: dict, layout: str, rank: int, role: str) -> CacheKey:
    known = set(CacheKey.__struct_fields__)
    merged = {**base, **{k: v for k, v in fields.items() if v is not None}}
    extra = {k: str(v) for k, v in (merged.pop("extra", None) or {}).items()}
    extra.update({k: str(v) for k, v in merged.items() if k not in known})
    args = {k: v for k, v in merged.items() if k in known}
    args.update(layout=layout, rank=rank, role=role, extra=extra)
    return CacheKey(**args)


def stamp_of(key: CacheKey, layout: Layout) -> dict[str, str]:
    """What every node must agree on: the key without its rank and model path (paths may differ between
    nodes, content digests may not), plus the cluster shape."""
    raw = msgspec.structs.asdict(key)
    for k in ("rank", "model"):
        raw.pop(k)
    extra = raw.pop("extra") or {}
    out = {k: str(v) for k, v in raw.items()}
    out.update({f"extra.{k}": str(v) for k, v in extra.items()})
    out["nodes"] = str(layout.nodes)
    out["world_size"] = str(layout.world_size)
    return out
