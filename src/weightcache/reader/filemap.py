"""A checkpoint file as the kernel holds it: a read-only shared mapping with its address (for DMA
registration), how much of it sits in the page cache, dropping it from the page cache, O_DIRECT."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path

PAGE = mmap.PAGESIZE
DIRECT_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers: a multiple of any logical block size in use
RESIDENT = 0.5  # "in the page cache" from this fraction of sampled pages (the auto io choices)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.statfs.restype = ctypes.c_int
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
IN_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type


class FileMap:
    """``PROT_READ`` / ``MAP_SHARED`` mapping of a whole file; ``addr`` is its address in this process."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.addr = 0
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise OSError(f"{self.path}: empty file")
            addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                e = ctypes.get_errno()
                raise OSError(e, f"mmap of {self.path} failed: {os.strerror(e)}")
        finally:
            os.close(fd)
        self.addr = int(addr)

    def resident_fraction(self, samples: int = 256) -> float:
        """Fraction of ``samples`` evenly spread pages that are in the page cache (mincore)."""
        pages = -(-self.size // PAGE)
        n = max(1, min(samples, pages))
        vec = ctypes.c_ubyte(0)
        hits = 0
        for i in range(n):
            page = i * pages // n
            if _libc.mincore(ctypes.c_void_p(self.addr + page * PAGE), PAGE, ctypes.byref(vec)) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"mincore on {self.path} failed: {os.strerror(e)}")
            hits += vec.value & 1
        return hits / n

    def close(self) -> None:
        if self.addr:
            _libc.munmap(ctypes.c_void_p(self.addr), self.size)
            self.addr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


_unmapping: list[threading.Thread] = []


def unmap_later(maps: list) -> None:
    """Close mappings (FileMaps, staging areas: anything with ``close()``) on a thread of their own: unmapping
    a whole checkpoint's page tables takes a while and the fill does not wait on
    it (the next mmap in the process does)."""
    if maps:
        t = threading.Thread(target=lambda: [m.close() for m in maps], name="wc-unmap", daemon=True)
        _unmapping[:] = [u for u in _unmapping if u.is_alive()]  # a long-lived daemon keeps no finished ones
        _unmapping.append(t)
        t.start()


def wait_unmapped() -> None:
    """Until every unmap_later before this call is done (a benchmark's runs start as a fresh process would)."""
    while _unmapping:
        _unmapping.pop().join()


def resident_fraction(path: Path | str, samples: int = 256) -> float:
    with FileMap(path) as m:
        return m.resident_fraction(samples)


def in_memory_fs(path: Path | str) -> bool:
    """The file lives on tmpfs or ramfs (``/dev/shm``): its pages are the file, not a cache of a disk."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type (a long) comes first
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in IN_MEMORY_FS


def drop_from_page_cache(path: Path | str) -> None:
    """Write back and evict a file's clean pages (posix_fadvise DONTNEED). Pages of tmpfs/ramfs, and pages
    someone has mapped or pinned, stay: check with :func:`resident_fraction`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_direct(path: Path | str) -> int | None:
    """An O_DIRECT descriptor, or None where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None


__all__ = ["DIRECT_ALIGN", "PAGE", "FileMap", "drop_from_page_cache", "open_direct", "resident_fraction",
           "unmap_later"]
