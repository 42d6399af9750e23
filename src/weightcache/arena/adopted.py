"""A block a replacement daemon took over from the custodian: served from its descriptor, never mapped here.

Clients import from fds, so the daemon hands out dups of the very fd the first daemon exported (an importer
cannot re-export a CUDA VMM handle; the exported fd itself can be passed on any number of times).

Before it is served, a block is checked without reading or writing it: a memfd must be sealed against writes,
shrinking and growing and be exactly its block's size; a CUDA handle must import as a VMM allocation on this
daemon's GPU, large enough for its block (a range of the block's size is mapped with no access granted, then
unmapped: the driver refuses a mapping past the allocation's end).
"""

from __future__ import annotations

import contextlib
import os
import uuid

from ..custodian.checks import memfd_problem
from ..errors import WeightCacheError


def _driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise WeightCacheError("CUDA blocks need NVIDIA's cuda-bindings: pip install 'weightcache[cuda]'") from None
    return cu


def _call(cu, result, what: str):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise WeightCacheError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def cuda_index_of(gpu_uuid: str) -> int:
    """The visible device index of the GPU ``gpu_uuid`` (as torch prints UUIDs), from the driver (no torch)."""
    cu = _driver()
    _call(cu, cu.cuInit(0), "cuInit")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    for index in range(_call(cu, cu.cuDeviceGetCount(), "cuDeviceGetCount")):
        raw = _call(cu, get_uuid(_call(cu, cu.cuDeviceGet(index), "cuDeviceGet")), "cuDeviceGetUuid")
        if str(uuid.UUID(bytes=bytes(raw.bytes))) == gpu_uuid:
            return index
    raise WeightCacheError(f"GPU {gpu_uuid} is not visible to this daemon")


@contextlib.contextmanager
def _primary_context(index: int):
    cu = _driver()
    _call(cu, cu.cuInit(0), "cuInit")
    dev = _call(cu, cu.cuDeviceGet(index), "cuDeviceGet")
    ctx = _call(cu, cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        _call(cu, cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            yield cu
        finally:
            cu.cuCtxPopCurrent()
    finally:
        cu.cuDevicePrimaryCtxRelease(dev)


def _check_cuda_handle(cu, fd: int, nbytes: int, index: int) -> None:
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        handle = _call(cu, cu.cuMemImportFromShareableHandle(fd, posix_fd), "cuMemImportFromShareableHandle")
    except WeightCacheError as e:
        raise WeightCacheError(f"is not a CUDA memory handle ({e})") from None
    try:
        prop = _call(cu, cu.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
        if int(prop.location.id) != index:
            raise WeightCacheError(f"lives on device {int(prop.location.id)}, not on this daemon's {index}")
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        gran = int(_call(cu, cu.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))
        if nbytes <= 0 or nbytes % gran:
            raise WeightCacheError(f"has a size of {nbytes}, not a multiple of the granularity {gran}")
        ptr = int(_call(cu, cu.cuMemAddressReserve(nbytes, gran, 0, 0), "cuMemAddressReserve"))
        try:
            try:  # no access is granted: nothing can be read or written through this mapping
                _call(cu, cu.cuMemMap(cu.CUdeviceptr(ptr), nbytes, 0, handle, 0), "cuMemMap")
            except WeightCacheError as e:
                raise WeightCacheError(f"is smaller than its block's {nbytes} bytes ({e})") from None
            cu.cuMemUnmap(cu.CUdeviceptr(ptr), nbytes)
        finally:
            cu.cuMemAddressFree(cu.CUdeviceptr(ptr), nbytes)
    finally:
        cu.cuMemRelease(handle)


def check_blocks(fds: list[int], sizes: list[int], device_type: str, index: int | None = None) -> None:
    """Raise WeightCacheError ("block I ...") for the first block that may not be served: a memfd not sealed or
    not of its size; a descriptor that is not a CUDA VMM handle of device `index` at least as large as its block.
    Uses the CUDA driver alone (no torch: a daemon that adopts may never import it)."""
    if device_type == "cpu":
        for i, (fd, n) in enumerate(zip(fds, sizes, strict=True)):
            problem = memfd_problem(fd, n)
            if problem:
                raise WeightCacheError(f"block {i} {problem}")
    elif device_type == "cuda":
        with _primary_context(0 if index is None else index) as cu:
            for i, (fd, n) in enumerate(zip(fds, sizes, strict=True)):
                try:
                    _check_cuda_handle(cu, fd, n, 0 if index is None else index)
                except WeightCacheError as e:
                    raise WeightCacheError(f"block {i} {e}") from None
    else:
        raise WeightCacheError(f"unknown device {device_type!r}")


class AdoptedBlock:
    """A block that passed ``check_blocks``, served from its descriptor."""

    def __init__(self, fd: int, nbytes: int, device_type: str):
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
