"""A block a replacement daemon took over from the custodian: served from its descriptor, never mapped here.

Clients import from fds, so the daemon hands out dups of the very fd the first daemon exported (an importer
cannot re-export a CUDA VMM handle; the exported fd itself can be passed on any number of times).

Before it is served, a block is checked without reading or writing it: a memfd must be sealed against writes,
shrinking and growing and be exactly its block's size; a CUDA handle must import as a VMM allocation on this
daemon's GPU, large enough for its block (a range of the block's size is mapped with no access granted, then
unmapped: the driver refuses a mapping past the allocation's end).
"""

from __future__ import annotations

import os

from ..custodian.checks import memfd_problem
from ..errors import WeightCacheError


def check_cuda_handle(fd: int, nbytes: int, index: int) -> None:
    """Raise WeightCacheError unless `fd` is a CUDA VMM handle of at least `nbytes` on device `index`."""
    from .cuda import CudaError, _check, cu, device_context, granularity

    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    with device_context(index):
        try:
            handle = _check(cu.cuMemImportFromShareableHandle(fd, posix_fd), "cuMemImportFromShareableHandle")
        except CudaError as e:
            raise WeightCacheError(f"is not a CUDA memory handle ({e})") from None
        try:
            prop = _check(cu.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
            if int(prop.location.id) != index:
                raise WeightCacheError(f"lives on device {int(prop.location.id)}, not on this daemon's {index}")
            gran = granularity(index)
            if nbytes <= 0 or nbytes % gran:
                raise WeightCacheError(f"its block size {nbytes} is not a multiple of the granularity {gran}")
            ptr = int(_check(cu.cuMemAddressReserve(nbytes, gran, 0, 0), "cuMemAddressReserve"))
            try:
                try:
                    _check(cu.cuMemMap(cu.CUdeviceptr(ptr), nbytes, 0, handle, 0), "cuMemMap")
                except CudaError as e:
                    raise WeightCacheError(f"is smaller than its block's {nbytes} bytes ({e})") from None
                cu.cuMemUnmap(cu.CUdeviceptr(ptr), nbytes)
            finally:
                cu.cuMemAddressFree(cu.CUdeviceptr(ptr), nbytes)
        finally:
            cu.cuMemRelease(handle)


class AdoptedBlock:
    def __init__(self, fd: int, nbytes: int, device_type: str, index: int | None = None):
        if device_type == "cpu":
            problem = memfd_problem(fd, nbytes)
            if problem:
                raise WeightCacheError(problem)
        elif device_type == "cuda":
            check_cuda_handle(fd, nbytes, 0 if index is None else index)
        else:
            raise WeightCacheError(f"unknown device {device_type!r}")
        self.fd, self.nbytes, self.device_type = fd, nbytes, device_type
        self.tensor = None  # not mapped: this daemon only serves it

    def seal(self) -> None:
        pass  # sealed (host) or synchronized (CUDA) by the daemon that filled it, and checked above

    def export_fd(self, readonly: bool) -> int:
        if self.device_type == "cpu" and readonly:  # a read-only descriptor cannot be mapped writable
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(self.fd)  # CUDA: read-only is enforced by the importer's access flags

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
