"""Page-locked staging for the CUDA fill: the driver's bindings, huge-page staging buffers, the native loop's windows (made ahead of a fill, off its path) and whether the driver page-locks page-cache pages."""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable

import torch

from . import native_fill
from .filemap import unmap_later
from .reading import CheckpointError
from .settings import ReadSettings

log = logging.getLogger("weightcache.reader.cuda_fill")

HUGE = 2 << 20
REGISTER_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY
REGISTER_PORTABLE = 0x01  # CU_MEMHOSTREGISTER_PORTABLE
WINDOW_FAULT_THREADS = 8  # threads that fault the native loop's windows in (faster than the kernel alone)
def driver():
    """cuda-bindings' driver module and weightcache's context helper, or (None, None) without them."""
    from ..arena import cuda as arena_cuda

    return (arena_cuda.cu, arena_cuda) if arena_cuda.cu is not None else (None, None)


def status(result):
    """The CUresult of a cuda-bindings call (which returns a tuple whose first item is it)."""
    return result[0] if isinstance(result, tuple) else result


def err_name(cu, err) -> str:
    try:
        _, name = cu.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        return str(err)


def register_supported(index: int) -> str:
    """"" if read-only host registration can work on this device, else why not."""
    cu, arena = driver()
    if cu is None:
        return "no cuda-bindings"
    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED", None)
    if attr is None:
        return ""
    try:
        with arena.device_context(index):
            err, dev = cu.cuDeviceGet(index)
            err2, value = cu.cuDeviceGetAttribute(attr, dev)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    if err != cu.CUresult.CUDA_SUCCESS or err2 != cu.CUresult.CUDA_SUCCESS:
        return "cannot query the device"
    return "" if value else "the device cannot register read-only host memory"


class HugeStaging:
    """A staging buffer in transparent huge pages, page-locked with cuMemHostRegister."""

    def __init__(self, nbytes: int):
        cu, _ = driver()
        if cu is None:
            raise RuntimeError("no cuda-bindings")
        self.cu = cu
        size = -(-nbytes // HUGE) * HUGE
        self._mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        shift = (-whole.data_ptr()) % HUGE
        self.tensor = whole[shift : shift + size]
        self.tensor.fill_(0)  # fault the huge pages in now
        self.ptr = self.tensor.data_ptr()
        err = status(cu.cuMemHostRegister(self.ptr, size, REGISTER_PORTABLE))
        if err != cu.CUresult.CUDA_SUCCESS:
            self.ptr = 0
            raise RuntimeError(f"cuMemHostRegister of a huge-page staging buffer: {err_name(cu, err)}")

    def close(self) -> None:
        if self.ptr:
            self.cu.cuMemHostUnregister(self.ptr)
            self.ptr = 0
        self.tensor = None
        with contextlib.suppress(BufferError):
            self._mm.close()  # else when the last view is gone


@functools.cache
def native_unavailable(why: str) -> None:
    log.warning("the native fill loop cannot be built (%s); torch's copies instead", why)


def context_handle(cu, arena, index: int) -> int:
    """The device's primary context (the driver's handle), 0 when copies do not go through the driver."""
    if not native_fill.USE_DRIVER:
        return 0
    with arena.device_context(index):
        err, current = cu.cuCtxGetCurrent()
    if status(err) != cu.CUresult.CUDA_SUCCESS:
        raise CheckpointError(f"no CUDA context for the fill: {err_name(cu, err)}")
    return int(current)


def make_windows(nbytes: int, ctx: int) -> native_fill.Windows:
    return native_fill.Windows(nbytes, lock=native_fill.USE_DRIVER, ctx=ctx,
                               threads=min(WINDOW_FAULT_THREADS, os.cpu_count() or 1))


def prepare_windows(settings: ReadSettings, index: int) -> EarlyWindows | None:
    """Start making the native loop's windows for a fill with ``settings`` into device ``index`` (before its
    destinations exist, so that it overlaps their allocation); None where that loop cannot read."""
    if settings.stage_read != "native":
        return None
    cu, arena = driver()
    if cu is None or native_fill.library()[0] is None:
        return None  # the fill says why
    return EarlyWindows(settings.window_bytes, settings.windows, index, context_handle(cu, arena, index))


class EarlyWindows:
    """The native loop's windows, made on a thread of their own (the kernel's and the driver's work: no
    GIL held) while the caller goes on."""

    def __init__(self, window_bytes: int, windows: int, index: int, ctx: int):
        self.shape = (window_bytes, windows, index)
        self._made: native_fill.Windows | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._make, args=(window_bytes * windows, ctx), name="wc-windows",
                                        daemon=True)
        self._thread.start()

    def _make(self, nbytes: int, ctx: int) -> None:
        try:
            self._made = make_windows(nbytes, ctx)
        except BaseException as e:  # noqa: BLE001 - raised where the windows are taken
            self._error = e

    def take(self) -> native_fill.Windows:
        self._thread.join()
        if self._error is not None:
            raise self._error
        made, self._made = self._made, None
        return made

    def release(self) -> None:
        """Windows never taken (no fill, or one that failed before its loop) are freed."""
        self._thread.join()
        if self._made is not None:
            unmap_later([self._made])
            self._made = None


class Slot:
    """One copy in flight: a CUDA event, the bytes it will have delivered, what to release after it."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.event = torch.cuda.Event()
        self.buf: torch.Tensor | None = None
        self.buf_owner: HugeStaging | None = None
        self.bytes = 0
        self.release: Callable[[], None] | None = None

    def drain(self, report: Callable[[int], None] | None) -> None:
        if not (self.bytes or self.release):
            return
        try:
            self.event.synchronize()
        finally:
            if self.release is not None:
                release, self.release = self.release, None
                release()
        if self.bytes and report is not None:
            report(self.bytes)
        self.bytes = 0

    def free(self) -> None:
        self.buf = None
        if self.buf_owner is not None:
            self.buf_owner.close()
            self.buf_owner = None
