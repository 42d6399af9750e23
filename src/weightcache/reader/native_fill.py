"""The staged fill's copy loop in native threads (``native/fill_loop.c``), built with the machine's C compiler
on first use and cached; None where it cannot be built (the Python pipeline reads instead).

The loop packs the pieces into window-sized loads itself. Workers take the next tile of the next window wherever
it is (no barrier per window, no GIL), the worker that copies a window's last tile queues its device copies.
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from .. import native_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "fill_loop.c"
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-pthread")
CACHE_ENV = native_build.CACHE_ENV
USE_DRIVER = True  # False: the "device copies" are host memcpys (tests with a stand-in driver)
POLL_SECONDS = 0.01
SKIP_HOST_COPY, SKIP_DEVICE_COPY = 2, 4  # run()'s flags, to measure each side alone (bench/native_probe.py)
STATS = ("started", "first_queued", "last_queued", "joined", "synced", "waited", "copying", "queueing", "loads")
last_stats: dict[str, float] = {}  # seconds (loads: how many), of the last run in this process (bench/native_probe.py)
_u64p = ctypes.POINTER(ctypes.c_uint64)
_i64p = ctypes.POINTER(ctypes.c_int64)


class NativeFillError(RuntimeError):
    """The loop failed: ``code`` is the CUDA error (or negative: -1 memory, -2 threads, -3 no driver);
    ``piece`` the first piece of the window it hit (-1: none)."""

    def __init__(self, code: int, piece: int):
        super().__init__(f"native fill failed with {code} at piece {piece}")
        self.code, self.piece = code, piece


class Pieces:
    """The loop's plan, column by column as it reads it: each piece's source address (in its file's mapping),
    destination address, bytes and file (a number: loads never span two). Pieces of a file go in offset
    order."""

    __slots__ = ("src", "dst", "nbytes", "file")

    def __init__(self):
        self.src, self.dst, self.nbytes, self.file = array.array("Q"), array.array("Q"), array.array("Q"), array.array("q")

    @classmethod
    def of(cls, pieces) -> Pieces:
        """From (source, destination, bytes[, file]) tuples."""
        out = cls()
        for p in pieces:
            out.src.append(p[0]), out.dst.append(p[1]), out.nbytes.append(p[2]), out.file.append(p[3] if len(p) > 3 else 0)
        return out

    def __len__(self) -> int:
        return len(self.src)


def plan_pieces(pieces, file_addrs: dict, dst_ptrs: dict) -> tuple[Pieces, list]:
    """The loop's plan for read-plan pieces: source address (the file's mapping at ``file_addrs[file]`` plus
    the offset), destination (``dst_ptrs[name]`` plus the piece's offset), bytes and file index, file by file
    in offset order; and the pieces in that order (to name one an error points at)."""
    by_file: dict = {}
    for p in pieces:
        group = by_file.get(p.file)
        if group is None:
            by_file[p.file] = [p]
        else:
            group.append(p)
    plan, ordered = Pieces(), []
    src, dst, nbytes, files = plan.src.append, plan.dst.append, plan.nbytes.append, plan.file.append
    for k, f in enumerate(sorted(by_file, key=str)):
        group = sorted(by_file[f], key=lambda p: p.offset)
        base = file_addrs[f]
        for p in group:
            src(base + p.offset), dst(dst_ptrs[p.name] + p.dst_offset), nbytes(p.nbytes), files(k)
        ordered += group
    return plan, ordered


def built_name() -> str:
    """The library's file name in the cache: one per version of the source and flags."""
    return native_build.built_name(SOURCE, list(CFLAGS))


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    lib, why = native_build.build(SOURCE, list(CFLAGS), ("-ldl",))
    if lib is None:
        return None, why
    lib.wc_fill_run.restype = ctypes.c_int
    vp = ctypes.c_void_p  # the plan's arrays: array.array buffers
    lib.wc_fill_run.argtypes = [vp, vp, vp, vp, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_uint64), _i64p, ctypes.c_int, _u64p]
    lib.wc_windows_make.restype = ctypes.c_int
    lib.wc_windows_make.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, _u64p, _u64p]
    lib.wc_windows_free.restype = None
    lib.wc_windows_free.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p]
    return lib, ""


class Windows:
    """``nbytes`` for the windows: anonymous memory in transparent huge pages, faulted in by
    ``threads`` threads (0: by the kernel, MADV_POPULATE_WRITE) and, with ``lock``, page-locked in context
    ``ctx``. Raises NativeFillError."""

    def __init__(self, nbytes: int, lock: bool, ctx: int = 0, threads: int = 0):
        lib, why = library()
        if lib is None:
            raise RuntimeError(f"native fill loop unavailable: {why}")
        if not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"windows of {nbytes!r} bytes")
        self._lib, self.nbytes, self.ctx, self.locked = lib, nbytes, ctx, lock
        out = (ctypes.c_uint64 * 3)()
        ns = (ctypes.c_uint64 * 3)()
        rc = lib.wc_windows_make(nbytes, threads, int(lock), ctx, out, ns)
        if rc != 0:
            raise NativeFillError(rc, -1)
        self._map, self._len, self.base = out[0], out[1], out[2]
        self.seconds = {"map": ns[0] / 1e9, "fault": ns[1] / 1e9, "lock": ns[2] / 1e9}

    def close(self) -> None:
        if self._map:
            self._lib.wc_windows_free(self._map, self._len, self.base, int(self.locked), self.ctx)
            self._map = 0


def run(pieces: Pieces | list[tuple[int, ...]], windows: int, window_bytes: int, nwin: int, threads: int, tile: int,
        report: Callable[[int], None], ctx: int = 0, stream: int = 0, cuda: bool | None = None, flags: int = 0) -> None:
    """``pieces``: a Pieces, or (source address, destination address, bytes[, file]) tuples; ``windows``: the
    address of ``nwin`` page-locked windows of ``window_bytes``. ``report`` gets the bytes delivered as
    windows come free. Raises NativeFillError."""
    lib, why = library()
    if lib is None:
        raise RuntimeError(f"native fill loop unavailable: {why}")
    for what, v in (("windows", nwin), ("threads", threads), ("tile", tile), ("window_bytes", window_bytes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    if not isinstance(pieces, Pieces):
        pieces = Pieces.of(pieces)
    cols = [c if c else array.array(c.typecode, [0])  # no empty buffers; alive until run returns
            for c in (pieces.src, pieces.dst, pieces.nbytes, pieces.file)]
    args = (*(c.buffer_info()[0] for c in cols), len(pieces))
    done = ctypes.c_uint64(0)
    err_piece = ctypes.c_int64(-1)
    result: list[int] = []
    use_driver = USE_DRIVER if cuda is None else cuda
    stats = (ctypes.c_uint64 * len(STATS))()

    def call() -> None:  # ctypes lets go of the GIL for the call
        result.append(lib.wc_fill_run(*args, windows, window_bytes, nwin, threads, tile, int(use_driver), ctx,
                                      stream, ctypes.byref(done), ctypes.byref(err_piece), flags, stats))

    worker = threading.Thread(target=call, name="wc-fill-native", daemon=True)
    worker.start()
    sent = 0
    try:
        while worker.is_alive():
            worker.join(POLL_SECONDS)
            now = done.value
            if now > sent:
                report(now - sent)
                sent = now
    finally:
        worker.join()  # the windows stay until the loop has stopped using them, whatever happens here
    last_stats.clear()
    last_stats.update({k: v if k == "loads" else v / 1e9 for k, v in zip(STATS, stats, strict=True)})
    rc = result[0] if result else -2
    if rc != 0:
        raise NativeFillError(rc, err_piece.value)
    if done.value > sent:
        report(done.value - sent)


__all__ = ["NativeFillError", "Pieces", "Windows", "library", "run"]
