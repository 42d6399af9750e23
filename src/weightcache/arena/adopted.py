"""A block a replacement daemon took over from the custodian: served from its descriptor, never mapped here.

Clients import from fds, so the daemon hands out dups of the very fd the first daemon exported (an importer
cannot re-export a CUDA VMM handle; the exported fd itself can be passed on any number of times).
"""

from __future__ import annotations

import os

from ..errors import WeightCacheError


class AdoptedBlock:
    def __init__(self, fd: int, nbytes: int, device_type: str):
        if device_type == "cpu":
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise WeightCacheError(f"held block file is {size} bytes, its manifest says {nbytes}")
        self.fd, self.nbytes, self.device_type = fd, nbytes, device_type
        self.tensor = None  # not mapped: this daemon only serves it

    def seal(self) -> None:
        pass  # sealed (host) or synchronized (CUDA) by the daemon that filled it

    def export_fd(self, readonly: bool) -> int:
        if self.device_type == "cpu" and readonly:  # a read-only descriptor cannot be mapped writable
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(self.fd)  # CUDA: read-only is enforced by the importer's access flags

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
