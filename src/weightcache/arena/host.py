"""Host (CPU) arena blocks: memfd files, mapped shared, exported as file descriptors."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import warnings

import torch

from ..errors import ArenaOutOfMemory

PAGE = mmap.PAGESIZE
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


class HostBlock:
    """One memfd-backed block owned by a daemon."""

    def __init__(self, nbytes: int, name: str = "weightcache"):
        self.nbytes = (max(nbytes, 1) + PAGE - 1) // PAGE * PAGE
        if self.nbytes > available_host_memory():
            raise _out_of_memory(self.nbytes, "not enough free memory")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            try:
                os.posix_fallocate(self.fd, 0, self.nbytes)  # reserve now: fail clearly, never SIGBUS later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise _out_of_memory(self.nbytes, e.strerror) from None
                raise
            self._mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = _tensor_over(self._mm)
        self._addr = self.tensor.data_ptr()
        with _live_lock:
            _live[self._addr] = (self.nbytes, self.fd)

    def seal(self) -> None:
        """No one (importers included) may shrink or grow the file after the fill."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)

    def export_fd(self, readonly: bool) -> int:
        """A new descriptor for a client; read-only ones cannot be mapped writable."""
        if readonly:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(self.fd)

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
        self._mm = None  # unmapped when the last view dies
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def import_host_blocks(fds: list[int], sizes: list[int], readonly: bool) -> list[torch.Tensor]:
    """Map received memfds; closes the fds. Mappings live as long as any tensor over them."""
    out = []
    try:
        for fd, size in zip(fds, sizes, strict=True):
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"block file is {actual} bytes, manifest says {size}")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            out.append(_tensor_over(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)))
    finally:
        for fd in fds:
            os.close(fd)
    return out
