"""Rates of the parts of a CUDA fill from the page cache, each alone: where does a load's time go?

    python bench/fill_probe.py --file-gb 8 --dir /dev/shm/wcprobe --threads 16

Parts: allocating pinned staging buffers, preadv into pinned buffers (the CPU copy), memcpy from the file's
mapping into pinned buffers, pinned -> device, the staged pipeline with buffers allocated up front,
cuMemHostRegister of the page cache (per range and the whole file), and register + copy. Prints a table
and writes bench/results/fill-probe-<device>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from weightcache.reader.filemap import FileMap  # noqa: E402
from weightcache.reader.reading import run_workers  # noqa: E402

MiB = 1 << 20
MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _file(path: Path, nbytes: int) -> None:
    if path.exists() and path.stat().st_size == nbytes:
        return
    block = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)


def _parallel(threads: int, chunks: list, work) -> float:
    """Seconds for ``threads`` workers (the source's own ``run_workers``) to run ``work(worker_index, chunk)``
    over every chunk, each with the caller's CUDA context current, for the driver calls."""
    from cuda.bindings import driver as cu

    _, ctx = cu.cuCtxGetCurrent()
    ids = itertools.count()

    def worker(next_item):
        i = next(ids)
        cu.cuCtxSetCurrent(ctx)
        while (c := next_item()) is not None:
            work(i, c)

    t = time.perf_counter()
    run_workers(threads, chunks, worker)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file-gb", type=float, default=8.0)
    ap.add_argument("--dir", default="/dev/shm/wcprobe")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--register-mb", type=int, default=128)
    ap.add_argument("--keep", action="store_true", help="keep the probe file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fill_probe needs CUDA", file=sys.stderr)
        return 2
    from cuda.bindings import driver as cu

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "probe.bin"
    chunk = args.chunk_mb * MiB
    nbytes = int(args.file_gb * 1e9) // (64 * MiB) * (64 * MiB)
    _file(path, nbytes)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    torch.cuda.init()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    mapped = torch.frombuffer(memoryview(mm), dtype=torch.uint8)  # read-only view (warning is expected)
    addr = mapped.data_ptr()
    offs = list(range(0, nbytes, chunk))
    rows = []

    def row(name, seconds, nb=nbytes, note=""):
        rows.append({"part": name, "bytes": nb, "seconds": seconds, "gb_per_s": nb / seconds / 1e9, "note": note})
        print(f"  {name:<44} {nb / 1e9:7.2f} GB {seconds:7.3f} s {nb / seconds / 1e9:7.1f} GB/s  {note}", flush=True)

    nbuf = max(args.threads * 2, 48)  # the memmove rows run up to 24 threads with 2 buffers each
    t = time.perf_counter()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    row("pinned alloc (torch, fresh)", time.perf_counter() - t, nbuf * chunk, f"{nbuf} x {args.chunk_mb} MiB")
    for huge in (True, False):
        t = time.perf_counter()
        area = mmap.mmap(-1, nbuf * chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)
        view = torch.frombuffer(area, dtype=torch.uint8)
        view.fill_(0)
        err, = cu.cuMemHostRegister(view.data_ptr(), nbuf * chunk, 0x01)
        row(f"mmap{' + huge pages' if huge else ''} + fill + cuMemHostRegister", time.perf_counter() - t,
            nbuf * chunk, str(err).split(".")[-1].rstrip(">"))
        if err == cu.CUresult.CUDA_SUCCESS:
            cu.cuMemHostUnregister(view.data_ptr())
        del view
        area.close()
    streams = [torch.cuda.Stream() for _ in range(args.threads)]

    def pread_into(b, off):
        os.preadv(fd, [memoryview(b.numpy())], off)

    def memcpy_into(b, off):
        b.copy_(mapped[off : off + chunk])

    row("preadv -> pinned (CPU copy only)", _parallel(args.threads, offs, lambda i, off: pread_into(bufs[i], off)))
    row("mmap memcpy -> pinned (CPU copy only)",
        _parallel(args.threads, offs, lambda i, off: memcpy_into(bufs[i], off)))

    def h2d(i, off):
        with torch.cuda.stream(streams[i]):
            dev[off : off + chunk].copy_(bufs[i], non_blocking=True)
        streams[i].synchronize()

    row("pinned -> device (no CPU copy)", _parallel(args.threads, offs, h2d))

    events = [[torch.cuda.Event(), torch.cuda.Event()] for _ in range(args.threads)]
    turn = [0] * args.threads

    def staged_with(copy_in):
        def staged(i, off):
            k = turn[i]
            turn[i] ^= 1
            b, ev = bufs[2 * i + k], events[i][k]
            ev.synchronize()
            copy_in(b, off)
            with torch.cuda.stream(streams[i]):
                dev[off : off + chunk].copy_(b, non_blocking=True)
            ev.record(streams[i])

        return staged

    row("staged pipeline (preadv, buffers up front)", _parallel(args.threads, offs, staged_with(pread_into)),
        note="depth 2")
    row("staged pipeline (mmap memcpy, buffers up front)", _parallel(args.threads, offs, staged_with(memcpy_into)),
        note="depth 2")

    # libc memmove out of a fresh mapping of the file each row (its page faults are part of the cost)
    def memmove_rows(threads: int, chunk_mb: int, populate: bool = False, staged: bool = False,
                     register_workers: int = 0):
        c = chunk_mb * MiB
        fm = FileMap(path)
        coffs = list(range(0, nbytes, c))
        turns = [0] * threads
        evs = [[torch.cuda.Event(), torch.cuda.Event()] for _ in range(threads)]
        strs = [torch.cuda.Stream() for _ in range(threads)]

        def work(i, off):
            n = min(c, nbytes - off)
            if i < register_workers:  # register, queue the copy, unregister two ranges later
                err, = cu.cuMemHostRegister(fm.addr + off, n, 0x08)
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuMemHostRegister: {err}")
                cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + off), fm.addr + off, n,
                                     cu.CUstream(strs[i].cuda_stream))
                ev = torch.cuda.Event()
                ev.record(strs[i])
                pending[i].append((ev, fm.addr + off))
                if len(pending[i]) > 2:
                    ev, a = pending[i].pop(0)
                    ev.synchronize()
                    cu.cuMemHostUnregister(a)
                return
            k = turns[i]
            turns[i] ^= 1
            b = bufs[(2 * i + k) % len(bufs)] if staged else bufs[i % len(bufs)]
            if staged:
                evs[i][k].synchronize()
            if populate:
                _libc.madvise(fm.addr + off, n, MADV_POPULATE_READ)
            ctypes.memmove(b.data_ptr(), fm.addr + off, n)
            if staged:
                with torch.cuda.stream(strs[i]):
                    dev[off : off + n].copy_(b[:n], non_blocking=True)
                evs[i][k].record(strs[i])

        pending = [[] for _ in range(threads)]
        secs = _parallel(threads, coffs, work)
        for q in pending:
            for _, a in q:
                cu.cuMemHostUnregister(a)
        t = time.perf_counter()
        fm.close()
        what = (f"{'hybrid: ' + str(register_workers) + ' register + ' if register_workers else ''}"
                f"{'staged memmove' if staged else 'memmove -> pinned'}{' + populate' if populate else ''}")
        row(f"{what}, {threads} thr, {chunk_mb} MiB", secs, note=f"munmap {time.perf_counter() - t:.3f} s")

    for threads, cmb in ((16, 16), (16, 64), (8, 16), (24, 16), (32, 4)):
        memmove_rows(threads, cmb)
    memmove_rows(16, 16, populate=True)
    for threads, cmb in ((16, 16), (16, 4), (24, 16)):
        memmove_rows(threads, cmb, staged=True)
    for threads, rw in ((16, 1), (16, 2), (16, 4), (17, 1), (18, 2)):
        memmove_rows(threads, 16, staged=True, register_workers=rw)
    memmove_rows(16, 64, staged=True, register_workers=1)
    def pageable_row(threads: int, chunk_mb: int):
        c = chunk_mb * MiB
        fm = FileMap(path)
        strs = [torch.cuda.Stream() for _ in range(threads)]

        def work(i, off):
            n = min(c, nbytes - off)
            cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + off), fm.addr + off, n,
                                 cu.CUstream(strs[i].cuda_stream))
            strs[i].synchronize()

        row(f"pageable mapping -> device (driver staging), {threads} thr, {chunk_mb} MiB",
            _parallel(threads, list(range(0, nbytes, c)), work))
        fm.close()

    pageable_row(16, 16)

    # one thread: torch's parallel copy (intra-op threads) into a few small windows, then the DMA: the staging
    # stays in the CPU cache
    from weightcache.reader.staging import HugeStaging

    def window_row(chunk_mb: int, windows: int, nstreams: int = 1):
        c = chunk_mb * MiB
        fm = FileMap(path)
        src = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(fm.addr), dtype=torch.uint8)
        stage = HugeStaging(windows * c)
        evs = [torch.cuda.Event() for _ in range(windows)]
        strs = [torch.cuda.Stream() for _ in range(nstreams)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, off in enumerate(range(0, nbytes, c)):
            w = k % windows
            evs[w].synchronize()
            n = min(c, nbytes - off)
            win = stage.tensor[w * c : w * c + n]
            win.copy_(src[off : off + n])
            st = strs[k % nstreams]
            cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + off), win.data_ptr(), n, cu.CUstream(st.cuda_stream))
            evs[w].record(st)
        torch.cuda.synchronize()
        row(f"1 thread, parallel copy into {windows} x {chunk_mb} MiB, {nstreams} stream(s)", time.perf_counter() - t,
            note=f"{torch.get_num_threads()} intra-op threads")
        src = None
        stage.close()
        fm.close()

    for cmb, w, ns in ((2, 8, 1), (4, 4, 1), (4, 8, 1), (8, 4, 1), (8, 4, 2), (16, 4, 1), (32, 3, 1), (1, 16, 1)):
        window_row(cmb, w, ns)
    ok_w = bool(torch.equal(dev[-chunk:].cpu(), mapped[nbytes - chunk :]))
    print(f"  window rows checked: {'ok' if ok_w else 'MISMATCH'}")

    torch.set_num_threads(1)
    row("torch copy_ (1 intra-op thread) -> pinned", _parallel(args.threads, offs, lambda i, off: memcpy_into(bufs[i], off)))
    torch.set_num_threads(os.cpu_count())

    reg = args.register_mb * MiB
    roffs = list(range(0, nbytes, reg))

    def register(off) -> int:
        n = min(reg, nbytes - off)
        err, = cu.cuMemHostRegister(addr + off, n, 0x08)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemHostRegister: {err}")
        return n

    def register_only(i, off):
        register(off)
        cu.cuMemHostUnregister(addr + off)

    try:
        row(f"cuMemHostRegister {args.register_mb} MiB ranges (no copy)", _parallel(args.threads, roffs, register_only))
        row(f"cuMemHostRegister {args.register_mb} MiB ranges, 1 thread", _parallel(1, roffs, register_only))

        def register_copy(i, off):
            n = register(off)
            cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + off), addr + off, n,
                                 cu.CUstream(streams[i].cuda_stream))
            streams[i].synchronize()
            cu.cuMemHostUnregister(addr + off)

        row(f"register + copy {args.register_mb} MiB ranges", _parallel(args.threads, roffs, register_copy))
        t = time.perf_counter()
        err, = cu.cuMemHostRegister(addr, nbytes, 0x08)
        t_reg = time.perf_counter() - t
        row("cuMemHostRegister whole file", t_reg)

        def copy_registered(i, off):
            cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + off), addr + off, min(chunk, nbytes - off),
                                 cu.CUstream(streams[i].cuda_stream))
            streams[i].synchronize()

        row("copy from the registered file", _parallel(args.threads, offs, copy_registered))
        t = time.perf_counter()
        cu.cuMemHostUnregister(addr)
        row("cuMemHostUnregister whole file", time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001
        print(f"  register rows skipped: {type(e).__name__}: {e}")
    ok = bool(torch.equal(dev[:chunk].cpu(), mapped[:chunk]))
    print(f"  last copy checked: {'ok' if ok else 'MISMATCH'}")
    out = ROOT / "bench" / "results" / f"fill-probe-{torch.cuda.get_device_name(0).split()[-1].lower()}.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "cpus": os.cpu_count(),
                               "torch": torch.__version__, "args": vars(args), "checked": ok, "rows": rows},
                              indent=2))
    print(f"wrote {out}")
    mapped = None  # the view must go before the mapping closes
    mm.close()
    os.close(fd)
    if not args.keep:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
