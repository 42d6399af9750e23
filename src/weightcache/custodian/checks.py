"""What is checked before a cache is held or served again, without mapping or decoding its memory (and
without torch): where a deposit comes from (a daemon of a running preload: that preload's credential, and the
depositor's process descends from the preload's), that its name is its key's, that its manifest describes its
blocks, and that every memfd is sealed against writes, shrinking and growing and is as large as its block."""

from __future__ import annotations

import fcntl
import os

import msgspec

from ..key import CacheKey
from ..manifest import BlockSpec
from ..sockets import parse_socket_name
from .messages import Holding

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
MAX_ANCESTRY = 64  # process tree depth walked from a depositor up to its preload


class _ManifestHead(msgspec.Struct):
    """The part of a manifest the custodian checks (the tensors are skipped when decoding)."""

    blocks: list[BlockSpec]
    device: str = "cpu"
    gpu_uuid: str = ""


def parent_of(pid: int) -> int:
    """The parent pid of a process (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants."""
    for _ in range(MAX_ANCESTRY):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = parent_of(pid)
    return False


def memfd_problem(fd: int, nbytes: int) -> str:
    """"" when `fd` is a memfd sealed against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE), shrinking and
    growing, of exactly `nbytes` bytes; else what is wrong, in a few words."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        return f"is not a sealable memfd ({e.strerror})"
    missing = [what for what, bits in (("writes", fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE),
                                       ("shrinking", fcntl.F_SEAL_SHRINK), ("growing", fcntl.F_SEAL_GROW))
               if not seals & bits]
    if missing:
        return f"is not sealed against {', '.join(missing)} (seals {seals:#x}): anyone holding it could change it"
    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        return f"cannot be inspected ({e.strerror})"
    if size != nbytes:
        return f"is {size} bytes, its block says {nbytes}"
    return ""


def identity_problem(h: Holding, key: bytes, manifest: bytes) -> str:
    """"" when the holding's name is its key's socket name (role, rank, device kind and key hash) and its
    manifest describes its blocks and device; else what is wrong."""
    parsed = parse_socket_name(h.name)
    if parsed is None:
        return f"{h.name!r} is not a daemon's socket name"
    try:
        k = msgspec.msgpack.decode(key, type=CacheKey)
    except (msgspec.DecodeError, ValueError) as e:
        return f"{h.name}: its key does not decode ({e})"
    if k.short_hash()[:8] != parsed["hash"]:
        return f"{h.name}: its key hashes to {k.short_hash()[:8]}, not to the name's {parsed['hash']}"
    if (k.role, k.rank, k.model) != (h.role, h.rank, h.model) or (parsed["role"], parsed["rank"]) != (h.role, h.rank):
        return (f"{h.name}: its key is {k.role} rank {k.rank} of {k.model!r}, its holding {h.role} rank {h.rank} of "
                f"{h.model!r}")
    if h.device not in ("cpu", "cuda") or (parsed["device"] == "cpu") != (h.device == "cpu"):
        return f"{h.name}: device {h.device!r} does not fit the name"
    try:
        head = msgspec.msgpack.decode(manifest, type=_ManifestHead)
    except (msgspec.DecodeError, ValueError) as e:
        return f"{h.name}: its manifest does not decode ({e})"
    if [b.nbytes for b in head.blocks] != h.block_bytes or any(n <= 0 for n in h.block_bytes):
        return f"{h.name}: its manifest's blocks {[b.nbytes for b in head.blocks]} are not its {h.block_bytes}"
    if (head.device, head.gpu_uuid) != (h.device, h.gpu_uuid):
        return f"{h.name}: its manifest is for {head.device} {head.gpu_uuid}, its holding {h.device} {h.gpu_uuid}"
    return ""


def blocks_problem(h: Holding, fds: list[int]) -> str:
    """"" when there is one fd per block and every memfd (CPU) is sealed and sized as its block; CUDA handles
    are opaque here (the adopting daemon checks them)."""
    if len(fds) != len(h.block_bytes):
        return f"{h.name}: {len(fds)} block fds for {len(h.block_bytes)} block sizes"
    if h.device == "cpu":
        for i, (fd, n) in enumerate(zip(fds, h.block_bytes, strict=True)):
            problem = memfd_problem(fd, n)
            if problem:
                return f"{h.name}: block {i} {problem}"
    return ""
