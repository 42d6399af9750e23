"""Host (CPU) arena blocks: memfd files, mapped shared, exported as file descriptors."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import warnings

import torch

from ..errors import ArenaOutOfMemory

PAGE = mmap.PAGESIZE


def _tensor_over(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we forbid writes by protection
        return torch.frombuffer(mm, dtype=torch.uint8)


class HostBlock:
    """One memfd-backed block owned by a daemon."""

    def __init__(self, nbytes: int, name: str = "weightcache"):
        self.nbytes = (max(nbytes, 1) + PAGE - 1) // PAGE * PAGE
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            try:
                os.posix_fallocate(self.fd, 0, self.nbytes)  # reserve now: fail clearly, never SIGBUS later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ArenaOutOfMemory(
                        f"cannot reserve {self.nbytes / 2**30:.2f} GiB of host memory for the arena: {e.strerror}"
                    ) from None
                raise
            self._mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = _tensor_over(self._mm)

    def seal(self) -> None:
        """No one (importers included) may shrink or grow the file after the fill."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)

    def export_fd(self, readonly: bool) -> int:
        """A new descriptor for a client; read-only ones cannot be mapped writable."""
        if readonly:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(self.fd)

    def close(self) -> None:
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
