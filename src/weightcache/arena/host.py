"""Host (CPU) arena blocks: memfd files, mapped shared, exported as file descriptors."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import warnings

import torch

from ..errors import ArenaOutOfMemory

log = logging.getLogger("weightcache.arena")

PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1

_live: dict[int, tuple[int, int]] = {}  # address of a live block's mapping -> (size, memfd)
_live_lock = threading.Lock()


def block_file_at(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """(memfd, offset) of the live block whose mapping holds [ptr, ptr + nbytes), else None. Writing through
    the file fills pages without faulting and zeroing them in this process (a loader's fast path)."""
    with _live_lock:
        for base, (size, fd) in _live.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return fd, ptr - base
    return None


def _tensor_over(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we forbid writes by protection
        return torch.frombuffer(mm, dtype=torch.uint8)


def available_host_memory() -> int:
    """Bytes this process may still take: MemAvailable, capped by the cgroup's limit when there is one."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read())
            avail = min(avail, int(limit) - used) if avail is not None else int(limit) - used
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 1 << 62


def _out_of_memory(nbytes: int, why: str) -> ArenaOutOfMemory:
    return ArenaOutOfMemory(
        f"cannot reserve {nbytes / 2**30:.2f} GiB of host memory for the arena "
        f"({available_host_memory() / 2**30:.2f} GiB available): {why}"
    )


# errno -> the limit it usually means, for a block the kernel refused
_LIMITS = {
    errno.ENOMEM: "out of memory or address space (RLIMIT_AS, ulimit -v)",
    errno.EFBIG: "larger than this process may write (RLIMIT_FSIZE, ulimit -f)",
    errno.ENOSPC: "no space left for shared memory",
}


def _refused(nbytes: int, e: OSError) -> OSError | ArenaOutOfMemory:
    """A kernel refusal of a block as ArenaOutOfMemory (with the limit it hit), any other error unchanged."""
    why = _LIMITS.get(e.errno)
    return _out_of_memory(nbytes, f"{e.strerror}: {why}") if why else e


class HostBlock:
    """One memfd-backed block owned by a daemon."""

    def __init__(self, nbytes: int, name: str = "weightcache"):
        self.nbytes = (max(nbytes, 1) + PAGE - 1) // PAGE * PAGE
        if self.nbytes > available_host_memory():
            raise _out_of_memory(self.nbytes, "not enough free memory")
        try:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise _refused(self.nbytes, e) from None
        try:
            os.ftruncate(self.fd, self.nbytes)  # EFBIG past RLIMIT_FSIZE
            os.posix_fallocate(self.fd, 0, self.nbytes)  # reserve now: fail clearly, never SIGBUS later
            self._writable = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)  # ENOMEM past RLIMIT_AS
        except OSError as e:
            os.close(self.fd)
            raise _refused(self.nbytes, e) from None
        except BaseException:
            os.close(self.fd)
            raise
        self._mm = None  # the read-only mapping, once sealed
        self.tensor = _tensor_over(self._writable)
        self._addr = self.tensor.data_ptr()
        with _live_lock:
            _live[self._addr] = (self.nbytes, self.fd)

    def seal(self) -> None:
        """After the fill no one may write the block again, the daemon included, nor an engine that reopens
        the memfd read-write through /proc: the daemon swaps its writable mapping for a read-only one and
        seals the file against writes (F_SEAL_WRITE once no writable mapping is left, else against every
        future write), shrinking and growing, and further seals."""
        if self._writable is None:
            return  # sealed already
        self._forget()  # no more writes through the file either
        try:
            ro = self.export_fd(True)  # a shared mapping of a read-write fd could be made writable again
            try:
                self._mm = mmap.mmap(ro, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(ro)
        except OSError as e:
            raise _refused(self.nbytes, e) from None
        self._writable = None  # unmapped now, or when the last view of the fill dies (never under a live view)
        self.tensor = _tensor_over(self._mm)
        base = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, base | fcntl.F_SEAL_WRITE)
        except OSError as e:
            if e.errno != errno.EBUSY:  # EBUSY: a writable mapping is left
                raise
            log.debug("a writable view of a %d-byte block outlived its fill; sealing against future writes",
                      self.nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, base | F_SEAL_FUTURE_WRITE)

    def export_fd(self, readonly: bool) -> int:
        """A new read-only descriptor for a client. A sealed block cannot be mapped writable and shared by
        anyone: engines that ask for writable tensors (readonly=False) map it privately (copy-on-write)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def _forget(self) -> None:
        with _live_lock:
            _live.pop(getattr(self, "_addr", None), None)

    def __del__(self):
        try:
            self._forget()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        self._forget()
        self.tensor = None
        self._mm = self._writable = None  # unmapped when the last view dies
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def import_host_blocks(fds: list[int], sizes: list[int], readonly: bool) -> list[torch.Tensor]:
    """Map received memfds; closes the fds. Mappings live as long as any tensor over them. Read-only
    mappings are shared; writable ones (readonly=False) are private copy-on-write mappings: the engine's
    writes land in its own pages, the shared (sealed) weights never change."""
    out = []
    try:
        for fd, size in zip(fds, sizes, strict=True):
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"block file is {actual} bytes, manifest says {size}")
            if readonly:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            else:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            out.append(_tensor_over(mm))
    finally:
        for fd in fds:
            os.close(fd)
    return out
