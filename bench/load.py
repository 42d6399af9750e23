"""Checkpoint load benchmark: weightcache's SafetensorsSource vs safetensors vs fastsafetensors, one run.

Writes a random bf16 Llama-shaped checkpoint (shards of --shard-gb) into --dir, reads it once to warm the
page cache, then loads it into device memory with each method and prints GB, seconds and GB/s:

* weightcache (preadv)  SafetensorsSource.fill into a weightcache arena (CUDA VMM / memfd blocks; plain
                        torch.empty buffers if the arena is unavailable): worker threads read into pinned
                        staging buffers and copy host->device on their own streams
* weightcache (mmap)    the same, copying from the safetensors mmap slices instead of preadv
* safetensors           safetensors.torch.load_file(file, device=...) per shard
* fastsafetensors       SafeTensorsFileLoader(nogds=True), if importable
* pinned H2D            one pinned buffer copied to the device: the host->device ceiling

    python bench/load.py --dir /mnt/nvme/wc-bench                  # ~16 GB on a GPU
    python bench/load.py --device cpu --size-gb 0.5 --dir /tmp/wcb  # anywhere

Results: bench/results/load-<host>.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from weightcache.checkpoints import estimate_llama_bytes, llama_config_for_bytes, make_llama_checkpoint  # noqa: E402
from weightcache.key import parse_dtype  # noqa: E402
from weightcache.sources.safetensors import SafetensorsSource  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_checkpoint(args) -> Path:
    path = Path(args.dir) / f"llama-{args.size_gb:g}gb-bf16"
    done = path / ".complete"
    if done.exists() and not args.rewrite:
        print(f"using existing checkpoint {path}")
        return path
    if path.exists():
        shutil.rmtree(path)
    kw = llama_config_for_bytes(int(args.size_gb * 1e9), torch.bfloat16)
    print(f"writing {estimate_llama_bytes(dtype=torch.bfloat16, **kw) / 1e9:.2f} GB checkpoint to {path}: {kw}")
    t0 = time.perf_counter()
    make_llama_checkpoint(path, dtype=torch.bfloat16, max_shard_bytes=int(args.shard_gb * 1e9), seed=0, **kw)
    print(f"  written in {time.perf_counter() - t0:.1f} s")
    done.touch()
    return path


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def warm_page_cache(files: list[Path]) -> float:
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    n = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    dt = time.perf_counter() - t0
    print(f"page cache warmed: {n / 1e9:.2f} GB in {dt:.1f} s ({n / 1e9 / dt:.1f} GB/s from disk or cache)")
    return dt


class ArenaViews:
    """Views over a weightcache arena (as a daemon builds them), or torch.empty buffers as a fallback."""

    def __init__(self, metas, device: torch.device, use_arena: bool):
        self.blocks = []
        self.kind = "torch.empty"
        if use_arena:
            try:
                from weightcache.arena import allocate_block
                from weightcache.manifest import build_views, plan_for_metas

                manifest = plan_for_metas(metas)
                for spec in manifest.blocks:
                    b = allocate_block(spec.nbytes, device)
                    spec.nbytes = b.nbytes
                    self.blocks.append(b)
                self.views = build_views(manifest, [b.tensor for b in self.blocks])
                self.kind = "arena"
                return
            except Exception as e:  # no cuda-bindings, old driver, ...
                print(f"  (weightcache arena unavailable: {type(e).__name__}: {e}; using torch.empty)")
                self.close()
        self.views = {m.name: torch.empty(m.shape, dtype=parse_dtype(m.dtype), device=device) for m in metas}

    def close(self) -> None:
        self.views = {}
        for b in self.blocks:
            b.close()
        self.blocks = []


def run_weightcache(path: Path, device: torch.device, args, io: str) -> dict:
    src = SafetensorsSource(path, device=device, threads=args.threads, chunk_bytes=args.chunk_mb << 20,
                            tp_rank=0, tp_size=args.tp, io=io, progress=False)
    t0 = time.perf_counter()
    arena = ArenaViews(src.describe(), device, not args.no_arena)
    sync(device)
    alloc = time.perf_counter() - t0
    t0 = time.perf_counter()
    src.fill(arena.views, lambda n: None)
    sync(device)
    dt = time.perf_counter() - t0
    checked = verify(src, arena.views, args.verify)
    arena.close()
    return {"bytes": src.nbytes, "seconds": dt, "alloc_seconds": alloc, "buffers": arena.kind, "verified": checked}


def verify(src: SafetensorsSource, views, n: int) -> int:
    """Compare n tensors (largest first) with what safetensors itself reads."""
    from safetensors import safe_open

    names = sorted(src.tensors, key=lambda k: -src.tensors[k].out_nbytes)[:n]
    for name in names:
        t = src.tensors[name]
        with safe_open(str(t.entry.file), framework="pt") as h:
            want = h.get_tensor(name)
        if src.tp_size > 1 and not t.spec.replicated:
            want = torch.cat([p.chunk(src.tp_size, t.spec.dim)[src.tp_rank]
                              for p in want.chunk(t.spec.split, t.spec.dim)], t.spec.dim)
        if not torch.equal(views[name].cpu(), want):
            raise AssertionError(f"weightcache loaded wrong bytes for {name}")
    return len(names)


def run_safetensors(files: list[Path], device: torch.device) -> dict:
    from safetensors.torch import load_file

    dev = str(device) if device.type == "cuda" else "cpu"
    held, n = [], 0
    t0 = time.perf_counter()
    for f in files:
        d = load_file(str(f), device=dev)
        n += sum(t.numel() * t.element_size() for t in d.values())
        held.append(d)
    sync(device)
    dt = time.perf_counter() - t0
    note = "cpu: tensors are mmap-backed, pages read lazily" if device.type == "cpu" else ""
    del held
    return {"bytes": n, "seconds": dt, "note": note}


def run_fastsafetensors(files: list[Path], device: torch.device) -> dict:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    t0 = time.perf_counter()
    loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
    try:
        loader.add_filenames({0: [str(f) for f in files]})
        fb = loader.copy_files_to_device()
        try:
            n = 0
            for key in fb.key_to_rank_lidx.keys() if hasattr(fb, "key_to_rank_lidx") else loader.get_keys():
                t = fb.get_tensor(key)
                n += t.numel() * t.element_size()
            sync(device)
            dt = time.perf_counter() - t0
        finally:
            fb.close()
    finally:
        loader.close()
    return {"bytes": n, "seconds": dt, "note": "nogds"}


def run_pinned_h2d(device: torch.device, nbytes: int = 4 << 30) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm up
    sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    dt = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": dt, "note": "ceiling: one pinned buffer -> device"}


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.environ.get("WC_BENCH_DIR", "/tmp/weightcache-bench"),
                   help="where to write the checkpoint (a local NVMe disk)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--size-gb", type=float, default=None, help="checkpoint size (default 16 on GPU, 0.5 on CPU)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=None, help="default: the source's (16, at most the cores)")
    p.add_argument("--chunk-mb", type=int, default=64, help="pinned staging buffer size per stream (x2 per thread)")
    p.add_argument("--tp", type=int, default=1, help="load rank 0 of this tensor-parallel size")
    p.add_argument("--runs", type=int, default=2, help="repeats per method (best and median reported)")
    p.add_argument("--methods", default="weightcache,weightcache-mmap,safetensors,fastsafetensors,h2d")
    p.add_argument("--no-arena", action="store_true", help="fill torch.empty buffers instead of the arena")
    p.add_argument("--verify", type=int, default=4, help="tensors compared with safetensors after a fill")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoint again even if present")
    p.add_argument("--cleanup", action="store_true", help="delete the checkpoint afterwards")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.size_gb is None:
        args.size_gb = 16.0 if device.type == "cuda" else 0.5

    path = make_checkpoint(args)
    files = weight_files(path)
    warm_page_cache(files)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    runners = {
        "weightcache": lambda: run_weightcache(path, device, args, "auto"),
        "weightcache-mmap": lambda: run_weightcache(path, device, args, "mmap"),
        "safetensors": lambda: run_safetensors(files, device),
        "fastsafetensors": lambda: run_fastsafetensors(files, device),
        "h2d": lambda: run_pinned_h2d(device),
    }
    unknown = set(methods) - set(runners)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {sorted(runners)}")
    results = []
    for m in methods:
        if m == "h2d" and device.type != "cuda":
            continue
        if m == "fastsafetensors":
            try:
                import fastsafetensors  # noqa: F401
            except ImportError:
                results.append({"method": m, "skipped": "not installed"})
                continue
        if m == "safetensors" and args.tp > 1:
            results.append({"method": m, "skipped": "loads whole tensors only (tp=1)"})
            continue
        runs = []
        try:
            for _ in range(args.runs):
                runs.append(runners[m]())
                free(device)
        except Exception as e:
            results.append({"method": m, "error": f"{type(e).__name__}: {e}"})
            free(device)
            continue
        secs = [r["seconds"] for r in runs]
        best = min(runs, key=lambda r: r["seconds"])
        res = {"method": m, **best, "seconds_all": secs, "seconds_median": statistics.median(secs),
               "gb": best["bytes"] / 1e9, "gb_per_s": best["bytes"] / 1e9 / best["seconds"]}
        results.append(res)
        print(f"  {m:<18} {res['gb']:7.2f} GB  {res['seconds']:7.3f} s  {res['gb_per_s']:6.1f} GB/s")

    print()
    print(f"{'method':<18} {'GB':>8} {'seconds':>9} {'GB/s':>7}  notes")
    for r in results:
        if "gb" in r:
            note = r.get("note") or (f"{r['buffers']}, verified {r['verified']} tensors" if "buffers" in r else "")
            print(f"{r['method']:<18} {r['gb']:8.2f} {r['seconds']:9.3f} {r['gb_per_s']:7.1f}  {note}")
        else:
            print(f"{r['method']:<18} {'-':>8} {'-':>9} {'-':>7}  {r.get('skipped') or r.get('error')}")

    host = socket.gethostname().split(".")[0]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"load-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "host": host,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "checkpoint": {"path": str(path), "files": len(files), "bytes": sum(f.stat().st_size for f in files)},
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results,
    }
    out.write_text(json.dumps(info, indent=2))
    print(f"\nwrote {out}")
    if args.cleanup:
        shutil.rmtree(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
