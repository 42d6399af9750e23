"""The digest's chunk sums on a GPU: ``digest.cu`` compiled at run time with NVRTC (cached on disk per
architecture), launched through the driver (on torch's current stream when torch is in use); it reads each
byte once, at memory speed. The driver path needs no torch: a daemon that took its cache over from the
custodian verifies it through a read-only mapping of the block's fd without importing torch. Where NVRTC or
the driver bindings are missing, torch's own operations compute the same sums (slower)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..native_build import cache_dir
from . import algorithm

log = logging.getLogger("weightcache.integrity")

SOURCE = Path(__file__).with_name("digest.cu")
THREADS, UNROLL, ROUNDS = 256, 8, 4
TILE_BYTES = THREADS * UNROLL * ROUNDS * 16  # what one CTA sums
FUNCTION = b"wc_digest_sums"
MAX_GRID = (1 << 31) - 1


class KernelUnavailable(RuntimeError):
    pass


def _options(arch: str) -> list[bytes]:
    return [f"--gpu-architecture={arch}".encode(), b"--std=c++17", f"-DWC_THREADS={THREADS}".encode(),
            f"-DWC_UNROLL={UNROLL}".encode(), f"-DWC_ROUNDS={ROUNDS}".encode()]


def _nvrtc_check(nvrtc, result, prog=None, what: str = "nvrtc"):
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        detail = ""
        if prog is not None:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, text)
            detail = ": " + text.decode(errors="replace").strip()
        raise KernelUnavailable(f"{what} failed ({err.name}){detail}")
    return values[0] if len(values) == 1 else values


def _preload_nvrtc() -> bool:
    """Load a libnvrtc found on the Python path (NVIDIA's wheels, torch's) so that cuda-bindings finds it
    loaded; True if one was."""
    import ctypes
    import glob
    import site

    torch = sys.modules.get("torch")
    roots = [*sys.path, *site.getsitepackages(), site.getusersitepackages(),
             str(Path(torch.__file__).parent / "lib") if torch is not None else ""]
    for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r)):
        for pattern in ("nvidia/*/lib/libnvrtc.so.*", "libnvrtc.so.*"):
            for path in sorted(glob.glob(os.path.join(root, pattern)), reverse=True):
                try:
                    ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
                    log.debug("loaded %s for the digest kernel", path)
                    return True
                except OSError:
                    continue
    return False


def compile_kernel(arch: str) -> bytes:
    """The kernel's CUBIN for ``arch`` (``sm_90``), from the disk cache or NVRTC."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise KernelUnavailable(f"cuda-bindings is not installed ({e})") from None
    try:
        version = _nvrtc_check(nvrtc, nvrtc.nvrtcVersion(), what="nvrtcVersion")
    except Exception as e:  # noqa: BLE001 - the library itself may be missing, or not where cuda-bindings looks
        if not _preload_nvrtc():
            raise KernelUnavailable(f"NVRTC unavailable: {e}") from None
        try:
            version = _nvrtc_check(nvrtc, nvrtc.nvrtcVersion(), what="nvrtcVersion")
        except Exception as e2:  # noqa: BLE001
            raise KernelUnavailable(f"NVRTC unavailable: {e2}") from None
    source = SOURCE.read_bytes()
    opts = _options(arch)
    tag = hashlib.sha256(source + b" ".join(opts) + repr(version).encode()).hexdigest()[:16]
    cached = cache_dir() / f"digest-{tag}-{arch}.cubin"
    try:
        return cached.read_bytes()
    except OSError:
        pass
    prog = _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(source, b"digest.cu", 0, [], []), what="nvrtcCreateProgram")
    try:
        _nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(prog, len(opts), opts), prog, f"compiling digest.cu for {arch}")
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), what="nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), what="nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as f:
            f.write(cubin)
        os.replace(f.name, cached)
    except OSError as e:
        log.debug("could not cache the digest kernel (%s)", e)
    return cubin


def _driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise KernelUnavailable(f"cuda-bindings is not installed ({e})") from None
    return cu


def _check(cu, result, what: str):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise KernelUnavailable(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


_lock = threading.Lock()
_contexts: dict[int, object] = {}
_functions: dict[int, object] = {}
_buffers: dict[int, tuple[int, int]] = {}  # device -> (address, bytes) of the sums' device buffer


@contextlib.contextmanager
def _context(index: int):
    """The device's primary context, current for the driver calls inside (torch uses the same one)."""
    cu = _driver()
    with _lock:
        ctx = _contexts.get(index)
        if ctx is None:
            _check(cu, cu.cuInit(0), "cuInit")
            dev = _check(cu, cu.cuDeviceGet(index), "cuDeviceGet")
            ctx = _contexts[index] = _check(cu, cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu, cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield cu
    finally:
        cu.cuCtxPopCurrent()


def _function(cu, index: int):
    """The kernel, loaded in the device's primary context (which must be current)."""
    with _lock:
        fn = _functions.get(index)
        if fn is None:
            attr = cu.CUdevice_attribute
            dev = _check(cu, cu.cuDeviceGet(index), "cuDeviceGet")
            major = _check(cu, cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
            minor = _check(cu, cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
            image = np.frombuffer(compile_kernel(f"sm_{major}{minor}"), dtype=np.uint8).copy()
            module = _check(cu, cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
            fn = _functions[index] = _check(cu, cu.cuModuleGetFunction(module, FUNCTION), "cuModuleGetFunction")
        return fn  # the module stays loaded with the process


def prepare_kernel(index: int) -> None:
    """Build (or read from the disk cache) and load the kernel on device ``index`` ahead of its first use; a
    use meanwhile waits for it instead of building it again. Raises KernelUnavailable as a use would."""
    with _context(index) as cu:
        _function(cu, index)


def _sums_buffer_locked(cu, index: int, nbytes: int) -> int:
    """The device's buffer for the sums, grown to ``nbytes`` (the caller holds _lock)."""
    addr, size = _buffers.get(index, (0, 0))
    if size < nbytes:
        if addr:
            cu.cuMemFree(cu.CUdeviceptr(addr))
        size = max(nbytes, 1 << 16)
        addr = int(_check(cu, cu.cuMemAlloc(size), "cuMemAlloc"))
        _buffers[index] = (addr, size)
    return addr


def device_sums(index: int, address: int, nbytes: int, chunk_bytes: int, stream: int = 0) -> np.ndarray:
    """``acc`` of every chunk of the ``nbytes`` of device memory at ``address`` (16-byte aligned) on device
    ``index``, by the kernel on ``stream`` (0: the legacy default stream); waits for it. No torch needed.
    Raises KernelUnavailable when the kernel cannot be built or run."""
    algorithm.check_chunk_bytes(chunk_bytes)
    n = algorithm.chunk_count(nbytes, chunk_bytes)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if address % 16:
        raise ValueError("the digest kernel reads 16-byte units: the block must start 16-byte aligned")
    tiles = -(-chunk_bytes // TILE_BYTES)
    if n * tiles > MAX_GRID:
        raise ValueError(f"{n} chunks of {chunk_bytes} bytes need more CTAs than one launch has")
    out = np.zeros(n, dtype=np.uint64)
    with _context(index) as cu:
        fn = _function(cu, index)
        with _lock:  # one user of the device's sums buffer at a time
            acc = _sums_buffer_locked(cu, index, out.nbytes)
            hstream = cu.CUstream(stream)
            _check(cu, cu.cuMemsetD8Async(cu.CUdeviceptr(acc), 0, out.nbytes, hstream), "cuMemsetD8Async")
            values = [np.array([v], dtype=np.uint64) for v in (address, nbytes, chunk_bytes, tiles, acc)]
            params = np.array([v.ctypes.data for v in values], dtype=np.uint64)
            _check(cu, cu.cuLaunchKernel(fn, n * tiles, 1, 1, THREADS, 1, 1, 0, hstream, params.ctypes.data, 0),
                   "cuLaunchKernel")
            _check(cu, cu.cuStreamSynchronize(hstream), "cuStreamSynchronize")
            _check(cu, cu.cuMemcpyDtoH(out.ctypes.data, cu.CUdeviceptr(acc), out.nbytes), "cuMemcpyDtoH")
    return out


def kernel_chunk_sums(block, chunk_bytes: int) -> np.ndarray:
    """``acc`` of every chunk of a 1-D uint8 CUDA torch tensor, by the kernel on the tensor's device and
    torch's current stream there."""
    import torch

    index = block.device.index
    stream = torch.cuda.current_stream(block.device).cuda_stream
    return device_sums(index, block.data_ptr(), block.numel() * block.element_size(), chunk_bytes, stream)


@contextlib.contextmanager
def mapped_fd(fd: int, nbytes: int, index: int):
    """A read-only mapping of a CUDA VMM block's POSIX fd on device ``index`` (the fd stays open): its
    device address, unmapped on exit. No torch needed."""
    with _context(index) as cu:
        fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = _check(cu, cu.cuMemImportFromShareableHandle(fd, fd_type), "cuMemImportFromShareableHandle")
        try:
            base = int(_check(cu, cu.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))
            try:
                _check(cu, cu.cuMemMap(cu.CUdeviceptr(base), nbytes, 0, handle, 0), "cuMemMap")
                try:
                    desc = cu.CUmemAccessDesc()
                    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    desc.location.id = index
                    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
                    _check(cu, cu.cuMemSetAccess(cu.CUdeviceptr(base), nbytes, [desc], 1), "cuMemSetAccess")
                    yield base
                finally:
                    cu.cuMemUnmap(cu.CUdeviceptr(base), nbytes)
            finally:
                cu.cuMemAddressFree(cu.CUdeviceptr(base), nbytes)
        finally:
            cu.cuMemRelease(handle)


_M1, _M2 = algorithm.M1 - (1 << 64), algorithm.M2 - (1 << 64)  # as int64: torch wraps int64 products


def _mix_int64(z):
    """``algorithm.mix_array`` on int64 tensors holding uint64 bits (logical shifts by masking)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@functools.lru_cache(maxsize=4)
def _keys(nwords: int, device):
    import torch

    j = torch.arange(nwords, dtype=torch.int64, device=device)
    return j * _signed(algorithm.STEP) + _signed(algorithm.SEED)


def torch_chunk_sums(block, chunk_bytes: int, slab_bytes: int = 256 << 20) -> np.ndarray:
    """The same ``acc`` with torch operations on the block's device (no kernel to build; several passes)."""
    import torch

    algorithm.check_chunk_bytes(chunk_bytes)
    block = block.reshape(-1)
    nbytes = block.numel()
    lengths = algorithm.chunk_lengths(nbytes, chunk_bytes)
    out = np.zeros(len(lengths), dtype=np.uint64)
    full = nbytes // chunk_bytes
    rows = max(1, slab_bytes // chunk_bytes)
    keys = _keys(chunk_bytes // 8, block.device)
    for r in range(0, full, rows):
        k = min(rows, full - r)
        words = block[r * chunk_bytes:(r + k) * chunk_bytes].view(torch.int64).view(k, chunk_bytes // 8)
        sums = _mix_int64(words ^ keys).sum(dim=1)
        out[r:r + k] = sums.cpu().numpy().view(np.uint64)
    if full < len(lengths):  # a last, shorter chunk: zero-padded to whole words
        tail = block[full * chunk_bytes:]
        padded = torch.zeros(-(-tail.numel() // 8) * 8, dtype=torch.uint8, device=block.device)
        padded[:tail.numel()] = tail
        words = padded.view(torch.int64)
        out[full] = np.int64(_mix_int64(words ^ keys[:words.numel()]).sum().item()).view(np.uint64)
    return out
