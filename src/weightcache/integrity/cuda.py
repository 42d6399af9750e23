"""The digest's chunk sums on a GPU: ``digest.cu`` compiled at run time with NVRTC (cached on disk per
architecture), launched through the driver on torch's current stream; it reads each byte once, at memory
speed. Where NVRTC or the driver bindings are missing, torch's own operations compute the same sums (slower)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from . import algorithm
from .native import cache_dir

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
    import sys

    roots = [*sys.path, *site.getsitepackages(), site.getusersitepackages(), str(Path(torch.__file__).parent / "lib")]
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


_lock = threading.Lock()
_functions: dict[int, object] = {}


def _function(index: int):
    with _lock:
        fn = _functions.get(index)
        if fn is not None:
            return fn
        from ..arena import cuda as arena_cuda

        if not arena_cuda.available():
            raise KernelUnavailable("cuda-bindings' driver API is not available")
        major, minor = torch.cuda.get_device_capability(index)
        image = np.frombuffer(compile_kernel(f"sm_{major}{minor}"), dtype=np.uint8).copy()
        cu = arena_cuda.cu
        with arena_cuda.device_context(index):
            module = arena_cuda._check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
            fn = arena_cuda._check(cu.cuModuleGetFunction(module, FUNCTION), "cuModuleGetFunction")
        _functions[index] = (module, fn)  # the module stays loaded with the process
        return _functions[index]


def kernel_chunk_sums(block: torch.Tensor, chunk_bytes: int) -> np.ndarray:
    """``acc`` of every chunk of a 1-D uint8 CUDA tensor (16-byte aligned), by the kernel on the tensor's
    device and its current stream. Raises KernelUnavailable when the kernel cannot be built or loaded."""
    from ..arena import cuda as arena_cuda

    algorithm.check_chunk_bytes(chunk_bytes)
    nbytes = block.numel()
    n = algorithm.chunk_count(nbytes, chunk_bytes)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if block.data_ptr() % 16:
        raise ValueError("the digest kernel reads 16-byte units: the block must start 16-byte aligned")
    index = block.device.index
    tiles = -(-chunk_bytes // TILE_BYTES)
    if n * tiles > MAX_GRID:
        raise ValueError(f"{n} chunks of {chunk_bytes} bytes need more CTAs than one launch has")
    _, fn = _function(index)
    cu = arena_cuda.cu
    with torch.cuda.device(index):
        acc = torch.zeros(n, dtype=torch.int64, device=block.device)
        stream = torch.cuda.current_stream(block.device)
        values = [np.array([v], dtype=np.uint64) for v in (block.data_ptr(), nbytes, chunk_bytes, tiles,
                                                             acc.data_ptr())]
        params = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        with arena_cuda.device_context(index):
            arena_cuda._check(cu.cuLaunchKernel(fn, n * tiles, 1, 1, THREADS, 1, 1, 0, cu.CUstream(stream.cuda_stream),
                                                params.ctypes.data, 0), "cuLaunchKernel")
        return acc.cpu().numpy().view(np.uint64)  # waits for the kernel (same stream)


_M1, _M2 = algorithm.M1 - (1 << 64), algorithm.M2 - (1 << 64)  # as int64: torch wraps int64 products


def _mix_int64(z: torch.Tensor) -> torch.Tensor:
    """``algorithm.mix_array`` on int64 tensors holding uint64 bits (logical shifts by masking)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@functools.lru_cache(maxsize=4)
def _keys(nwords: int, device: torch.device) -> torch.Tensor:
    j = torch.arange(nwords, dtype=torch.int64, device=device)
    return j * _signed(algorithm.STEP) + _signed(algorithm.SEED)


def torch_chunk_sums(block: torch.Tensor, chunk_bytes: int, slab_bytes: int = 256 << 20) -> np.ndarray:
    """The same ``acc`` with torch operations on the block's device (no kernel to build; several passes)."""
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
