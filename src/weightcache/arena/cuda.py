"""CUDA arena blocks through the driver's virtual memory management (VMM) API.

The daemon allocates with cuMemCreate (POSIX-fd shareable), maps read-write for itself and exports one fd per
block. A client imports every block into one contiguous virtual range and maps it read-only unless asked
otherwise, so a buggy engine faults instead of corrupting weights others share. The driver refcounts the
physical memory: mappings stay valid after the exporter exits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from ..errors import ArenaOutOfMemory, WeightCacheError

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - depends on the machine
    cu = None


class CudaError(WeightCacheError):
    pass


def available() -> bool:
    return cu is not None and torch.cuda.is_available()


def _require() -> None:
    if cu is None:
        raise WeightCacheError(
            "CUDA arenas need NVIDIA's cuda-bindings: pip install 'weightcache[cuda]'"
        )


def _check(result, what: str):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise ArenaOutOfMemory(f"{what}: {name}")
        raise CudaError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_ctx_lock = threading.Lock()
_primary: dict[int, object] = {}


@contextlib.contextmanager
def device_context(index: int):
    """Make the device's primary context current for driver calls, without touching torch's device."""
    _require()
    with _ctx_lock:
        ctx = _primary.get(index)
        if ctx is None:
            _check(cu.cuInit(0), "cuInit")
            dev = _check(cu.cuDeviceGet(index), "cuDeviceGet")
            ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _primary[index] = ctx
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        cu.cuCtxPopCurrent()


def _prop(index: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


@functools.cache
def granularity(index: int) -> int:
    with device_context(index):
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(_check(cu.cuMemGetAllocationGranularity(_prop(index), flag), "cuMemGetAllocationGranularity"))


def _access(index: int, readonly: bool):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    desc.flags = (
        cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly
        else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    return desc


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_for_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise WeightCacheError(
        f"the daemon's GPU {uuid} is not visible in this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
        "attach from a process that sees that GPU"
    )


class _Mapping:
    """A mapped virtual range; torch tensors made from it keep it alive, and it unmaps when they die."""

    def __init__(self, index: int, ptr: int, size: int, handles=()):
        self.index, self.ptr, self.size, self.handles = index, ptr, size, list(handles)
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
            "stream": None,
        }

    def tensor(self) -> torch.Tensor:
        return torch.as_tensor(self, device=torch.device("cuda", self.index))

    def __del__(self):
        if cu is None or not self.ptr:
            return
        try:
            with device_context(self.index):
                cu.cuMemUnmap(cu.CUdeviceptr(self.ptr), self.size)
                cu.cuMemAddressFree(cu.CUdeviceptr(self.ptr), self.size)
                for h in self.handles:
                    cu.cuMemRelease(h)
        except Exception:
            pass  # interpreter shutdown: the driver reclaims everything with the process
        self.ptr = 0


def _create_handle(index: int, size: int):
    try:
        return _check(cu.cuMemCreate(size, _prop(index), 0), f"cuMemCreate({size / 2**30:.2f} GiB)")
    except ArenaOutOfMemory:
        torch.cuda.empty_cache()  # memory cached by torch's allocator may be enough
        try:
            return _check(cu.cuMemCreate(size, _prop(index), 0), "cuMemCreate")
        except ArenaOutOfMemory:
            free, total = torch.cuda.mem_get_info(index)
            raise ArenaOutOfMemory(
                f"cannot allocate {size / 2**30:.2f} GiB on cuda:{index} ({gpu_uuid(index)}): "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"
            ) from None


class CudaBlock:
    """One VMM allocation owned by a daemon, mapped read-write in the daemon, exportable as a POSIX fd."""

    def __init__(self, nbytes: int, index: int):
        _require()
        self.index = index
        gran = granularity(index)
        self.nbytes = (max(nbytes, 1) + gran - 1) // gran * gran
        with device_context(index):
            handle = _create_handle(index, self.nbytes)
            try:
                ptr = int(_check(cu.cuMemAddressReserve(self.nbytes, gran, 0, 0), "cuMemAddressReserve"))
                _check(cu.cuMemMap(cu.CUdeviceptr(ptr), self.nbytes, 0, handle, 0), "cuMemMap")
                _check(cu.cuMemSetAccess(cu.CUdeviceptr(ptr), self.nbytes, [_access(index, False)], 1),
                       "cuMemSetAccess")
                fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                self.fd = int(_check(cu.cuMemExportToShareableHandle(handle, fd_type, 0),
                                     "cuMemExportToShareableHandle"))
            except BaseException:
                cu.cuMemRelease(handle)
                raise
        self._mapping = _Mapping(index, ptr, self.nbytes, [handle])
        self.tensor = self._mapping.tensor()

    def seal(self) -> None:
        torch.cuda.synchronize(self.index)

    def export_fd(self, readonly: bool) -> int:
        return os.dup(self.fd)  # read-only is enforced by the importer's access flags

    def close(self) -> None:
        self.tensor = None
        self._mapping = None  # released when the last view dies
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def import_cuda_blocks(fds: list[int], sizes: list[int], index: int, readonly: bool) -> list[torch.Tensor]:
    """Import every block into one contiguous virtual range with one access call; closes the fds."""
    _require()
    total = sum(sizes)
    fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        with device_context(index):
            gran = granularity(index)
            if any(s % gran for s in sizes):
                raise WeightCacheError(f"block sizes are not multiples of the device granularity {gran}")
            base = int(_check(cu.cuMemAddressReserve(total, gran, 0, 0), "cuMemAddressReserve"))
            mapped = 0
            try:
                for fd, size in zip(fds, sizes, strict=True):
                    handle = _check(cu.cuMemImportFromShareableHandle(fd, fd_type), "cuMemImportFromShareableHandle")
                    try:
                        _check(cu.cuMemMap(cu.CUdeviceptr(base + mapped), size, 0, handle, 0), "cuMemMap")
                    finally:
                        cu.cuMemRelease(handle)  # the mapping holds the allocation now
                    mapped += size
                _check(cu.cuMemSetAccess(cu.CUdeviceptr(base), total, [_access(index, readonly)], 1),
                       "cuMemSetAccess")
            except BaseException:
                if mapped:
                    cu.cuMemUnmap(cu.CUdeviceptr(base), mapped)
                cu.cuMemAddressFree(cu.CUdeviceptr(base), total)
                raise
    finally:
        for fd in fds:
            os.close(fd)
    whole = _Mapping(index, base, total).tensor()
    out, off = [], 0
    for size in sizes:
        out.append(whole[off:off + size])
        off += size
    return out
