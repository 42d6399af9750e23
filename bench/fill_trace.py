"""Where a real CUDA fill's time goes: SafetensorsSource into a weightcache arena, each worker's time summed by
part (CPU copy, waiting for a slot, queueing copies, windows, planning), summed over threads, next to the
wall time.

    python bench/fill_trace.py --dir /dev/shm/wcload --size-gb 16 --spec "io=staged,chunk_mb=16" --spec "..."

Prints a table per spec and writes bench/results/fill-trace-<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
import load  # noqa: E402
from weightcache.reader import cuda_fill, windows  # noqa: E402
from weightcache.sources.safetensors import SafetensorsSource  # noqa: E402

spent: dict[str, float] = collections.defaultdict(float)
_lock = threading.Lock()


def _timed(name: str, fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            with _lock:
                spent[name] += dt

    return run


def _instrument() -> None:
    cuda_fill.staging.Slot.drain = _timed("wait for a slot", cuda_fill.staging.Slot.drain)
    cuda_fill.CudaFill._staging = _timed("staging buffers", cuda_fill.CudaFill._staging)
    cuda_fill.CudaFill._to_device = _timed("queue copies", cuda_fill.CudaFill._to_device)
    cuda_fill.CudaFill._register = _timed("register + queue", cuda_fill.CudaFill._register)
    cuda_fill.CudaFill._choose_modes = _timed("choose modes, map files", cuda_fill.CudaFill._choose_modes)
    cuda_fill.CudaFill._window_memory = _timed("window memory", cuda_fill.CudaFill._window_memory)
    cuda_fill.CudaFill._close_windows = staticmethod(_timed("close windows", cuda_fill.CudaFill._close_windows))
    cuda_fill.CudaFill._window_loads = _timed("cut windows", cuda_fill.CudaFill._window_loads)
    cuda_fill.CudaFill._pipeline = _timed("window loop (all)", cuda_fill.CudaFill._pipeline)
    cuda_fill.unmap_later = _timed("unmap_later", cuda_fill.unmap_later)
    windows.unmap_later = _timed("unmap_later (windows)", windows.unmap_later)
    for name in ("read_plan", "_check_views"):
        setattr(SafetensorsSource, name, _timed(name.strip("_"), getattr(SafetensorsSource, name)))
    import ctypes

    cuda_fill.ctypes = SimpleNamespace(memmove=_timed("memmove", ctypes.memmove), c_ubyte=ctypes.c_ubyte)
    torch.Tensor.copy_ = _timed("torch copy_", torch.Tensor.copy_)
    orig = cuda_fill.read_into
    cuda_fill.read_into = _timed("preadv", orig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/wcload")
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--shard-gb", type=float, default=4)
    ap.add_argument("--spec", action="append", default=[], help="bench/load.py sweep options, repeatable")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-arena", action="store_true", help="fill torch.empty buffers instead of the arena")
    args = ap.parse_args(argv)
    path = load.make_checkpoint(args.dir, args.size_gb, args.shard_gb, False)
    load.warm_page_cache(load.weight_files(path))
    device = torch.device("cuda", 0)
    torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).to(device)
    _instrument()
    out = []
    for spec in args.spec or ["io=staged"]:
        opts = load.parse_spec(spec)
        for run in range(args.runs):
            t0 = time.perf_counter()
            src = SafetensorsSource(path, device=device, progress=False, **load.source_kwargs(opts, SimpleNamespace(
                threads=None, chunk_mb=0)))
            t1 = time.perf_counter()
            metas = src.describe()
            t2 = time.perf_counter()
            arena = load.ArenaViews(metas, device, not args.no_arena)
            torch.cuda.synchronize()
            setup = {"source": t1 - t0, "describe": t2 - t1, "arena": time.perf_counter() - t2}
            spent.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            src.fill(arena.views)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            parts = dict(spent)
            out.append({"spec": spec, "run": run, "buffers": arena.kind, "wall": wall, "gb_per_s": src.nbytes / wall / 1e9,
                        "threads": src.read.threads, "parts": parts, "setup": setup})
            print("  before the fill: " + ", ".join(f"{k} {v:.4f} s" for k, v in setup.items()))
            print(f"{spec} [{arena.kind}] run {run}: {wall:.4f} s {src.nbytes / wall / 1e9:.1f} GB/s ({src.read.threads} threads; "
                  "seconds summed over threads: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(parts.items())) + ")",
                  flush=True)
            arena.close()
            load.free(device)
    for kind in ("arena", "torch.empty"):  # what a destination of this size costs (InstantTensor's: torch's)
        nbytes = src.nbytes
        t = time.perf_counter()
        if kind == "arena":
            from weightcache.arena import allocate_block

            block = allocate_block(nbytes, device)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            block.close()
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            del buf
        load.free(device)
        out.append({"allocate": kind, "bytes": nbytes, "seconds": dt})
        print(f"allocate {nbytes / 1e9:.2f} GB ({kind}): {dt:.4f} s")
    res = ROOT / "bench" / "results" / f"fill-trace-{torch.cuda.get_device_name(0).split()[-1].lower()}.json"
    res.write_text(json.dumps(out, indent=2))
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
