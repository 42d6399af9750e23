"""Checkpoint load benchmark: weightcache's SafetensorsSource side by side with InstantTensor, fastsafetensors
and safetensors, in one run.

Writes a random bf16 Llama-shaped checkpoint (shards of --shard-gb) into --dir (tmpfs: /dev/shm), reads it
once to warm the page cache, then loads it into device memory with each method, --runs rounds (each round
runs every method once), and prints GB, seconds and GB/s (best run; first and median in the JSON). Every load is checked tensor by tensor against
what safetensors reads (--verify all), on the device.

Warm (page cache), methods (--methods):

* weightcache          SafetensorsSource.fill into a weightcache arena (CUDA VMM / memfd blocks), default
                       options (io="auto": DMA from the page-locked page cache when the file is cached);
                       seconds include parsing the headers and allocating the arena
* weightcache-<io>     the same with io=staged | register | direct | mmap | instanttensor
* instanttensor        InstantTensor safe_open(all files, device=N): one call, tensors it allocates (copy=True)
* instanttensor-view   InstantTensor's zero-copy mode (copy=False): views of its ring buffer, read, not kept
* fastsafetensors      SafeTensorsFileLoader(nogds=True): all files, tensors on the device
* safetensors          safetensors.torch.load_file(file, device=...) per shard
* h2d                  one pinned buffer copied to the device: the host-to-device ceiling (CUDA)
* memcpy, memcpy-fresh a plain copy between two touched buffers / into a fresh memfd block (CPU ceilings)

--sweep runs SafetensorsSource with other options in the same run: "h200" (a grid for one GPU) or specs
such as "io=register,threads=8,register_mb=256;io=staged,depth=3,streams=3". Keys: io, threads, chunk_mb,
register_mb, depth, streams, order (file|interleave), hugepages (0|1; else the source's default), stage_read
(native|pipeline|memcpy|preadv), window_mb, windows and tile_kb (the native loop's and the pipeline's), intra_threads (torch's intra-op threads, which
make the pipeline's copies), sendfile (0: CPU arena filled with preadv through its mapping instead of sendfile into its memfd).

Cold (--cold-dir on a real disk, --cold-gb): a second checkpoint is written there, and before each load its
pages are dropped from the page cache (posix_fadvise DONTNEED per file, else /proc/sys/vm/drop_caches); the
table says which worked and how much was still cached. --cold-methods: weightcache (auto: O_DIRECT for
uncached files), weightcache-staged, weightcache-register, instanttensor (its default: io_uring/AIO with
O_DIRECT), fastsafetensors.

    python bench/load.py --dir /dev/shm/wcload --cold-dir /tmp/wccold --sweep h200 --cleanup   # one GPU
    python bench/load.py --device cpu --size-gb 2 --dir /dev/shm/wcb                             # anywhere

InstantTensor and fastsafetensors are optional: a method whose package does not import is skipped with a note.
Results: bench/results/load-<host>.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from weightcache.dtypes import parse_dtype
from weightcache.reader.filemap import drop_from_page_cache, resident_fraction, wait_unmapped
from weightcache.reader.instanttensor import shard_of
from weightcache.sources.safetensors import SafetensorsSource
from weightcache.testing.checkpoints import (
    estimate_llama_bytes,
    llama_config_for_bytes,
    make_llama_checkpoint,
)

SWEEP_H200 = [  # window shapes around the default (4 x 16 MiB), the previous default, workers, the pipeline
    "io=staged,window_mb=16,windows=6",
    "io=staged,window_mb=12,windows=4",
    "io=staged,window_mb=8,windows=6",
    "io=staged,window_mb=32,windows=3",
    "io=staged,threads=16",
    "io=staged,stage_read=pipeline",
    "io=staged,stage_read=memcpy,chunk_mb=8",
]
SWEEP_KEYS = {"io": str, "threads": int, "chunk_mb": int, "register_mb": int, "depth": int, "streams": int,
              "order": str, "hugepages": int, "sendfile": int, "stage_read": str,
              "window_mb": int, "windows": int, "intra_threads": int, "tile_kb": int}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KEEP_PINNED = False  # --keep-pinned


def free(device: torch.device) -> None:
    """Between runs: what a run allocated goes back, pinned host memory cached by torch too (each daemon is a
    fresh process that pays for its staging buffers; InstantTensor and fastsafetensors allocate theirs per
    call), unless --keep-pinned; the mappings of the last fill unmapped (a fresh daemon has none pending)."""
    gc.collect()
    wait_unmapped()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if not KEEP_PINNED:
            for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"),
                                (torch._C, "_host_emptyCache"), (torch._C, "_accelerator_emptyHostCache")):
                fn = getattr(owner, name, None)
                if fn is not None:
                    fn()
                    break


def make_checkpoint(root: str, size_gb: float, shard_gb: float, rewrite: bool) -> Path:
    path = Path(root) / f"llama-{size_gb:g}gb-bf16"
    done = path / ".complete"
    if done.exists() and not rewrite:
        print(f"using existing checkpoint {path}")
        return path
    if path.exists():
        shutil.rmtree(path)
    kw = llama_config_for_bytes(int(size_gb * 1e9), torch.bfloat16)
    print(f"writing {estimate_llama_bytes(dtype=torch.bfloat16, **kw) / 1e9:.2f} GB checkpoint to {path}: {kw}")
    t0 = time.perf_counter()
    make_llama_checkpoint(path, dtype=torch.bfloat16, max_shard_bytes=int(shard_gb * 1e9), seed=0, **kw)
    print(f"  written in {time.perf_counter() - t0:.1f} s")
    done.touch()
    return path


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def warm_page_cache(files: list[Path]) -> None:
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    n = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    dt = time.perf_counter() - t0
    print(f"page cache warmed: {n / 1e9:.2f} GB in {dt:.1f} s ({n / 1e9 / dt:.1f} GB/s)")


def drop_page_cache(files: list[Path]) -> dict:
    """Evict the files: fadvise DONTNEED per file, then drop_caches if pages remain. Says what worked."""
    for f in files:
        drop_from_page_cache(f)
    left = max(resident_fraction(f) for f in files)
    how = "posix_fadvise(DONTNEED)"
    if left > 0.05:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
            how = "posix_fadvise(DONTNEED) + /proc/sys/vm/drop_caches"
        except OSError as e:
            how = f"posix_fadvise(DONTNEED) only (drop_caches: {e.strerror})"
        left = max(resident_fraction(f) for f in files)
    return {"dropped_by": how, "resident_after_drop": round(left, 3)}


class Reference:
    """What safetensors reads, on the device, sharded like the source: the check for every method."""

    def __init__(self, path: Path, device: torch.device, tp: int):
        from safetensors import safe_open

        self.src = SafetensorsSource(path, tp_rank=0, tp_size=tp, progress=False, io="mmap")
        self.tensors = {}
        t0 = time.perf_counter()
        for f in weight_files(path):
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    if name in self.src.tensors:
                        full = h.get_tensor(name)
                        part = shard_of(full, self.src.tensors[name], 0, tp)
                        self.tensors[name] = part.to(device) if device.type == "cuda" else part.clone()
        sync(device)
        print(f"reference tensors ready in {time.perf_counter() - t0:.1f} s")

    def check(self, got, what: str, limit: int | None) -> int:
        names = sorted(self.tensors, key=lambda k: -self.tensors[k].numel())
        if limit is not None:
            names = names[:limit]
        for name in names:
            if name not in got:
                raise AssertionError(f"{what}: no tensor {name!r}")
            if not torch.equal(got[name], self.tensors[name]):
                raise AssertionError(f"{what} loaded wrong bytes for {name}")
        return len(names)


class ArenaViews:
    """Views over a weightcache arena (as a daemon builds them), or torch.empty buffers as a fallback."""

    def __init__(self, metas, device: torch.device, use_arena: bool):
        self.blocks = []
        self.kind = "torch.empty"
        if use_arena:
            try:
                from weightcache.arena import allocate_block
                from weightcache.manifest import plan_for_metas
                from weightcache.packing import build_views

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


def parse_spec(text: str) -> dict:
    opts = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in SWEEP_KEYS or not value:
            raise ValueError(f"bad sweep item {part!r}; keys: {', '.join(SWEEP_KEYS)}")
        opts[key] = SWEEP_KEYS[key](value)
    return opts


def source_kwargs(opts: dict, args) -> dict:
    kw = {"threads": opts.get("threads", args.threads), "io": opts.get("io"), "depth": opts.get("depth", 2),
          "streams": opts.get("streams", 1), "order": opts.get("order", "file")}
    if "hugepages" in opts:
        kw["hugepages"] = bool(opts["hugepages"])
    for key in ("stage_read", "windows"):
        if key in opts:
            kw[key] = opts[key]
    if "window_mb" in opts:
        kw["window_bytes"] = opts["window_mb"] << 20
    if "tile_kb" in opts:
        kw["tile_bytes"] = opts["tile_kb"] << 10
    if "chunk_mb" in opts or args.chunk_mb:
        kw["chunk_bytes"] = (opts.get("chunk_mb") or args.chunk_mb) << 20
    if "register_mb" in opts:
        kw["register_bytes"] = opts["register_mb"] << 20
    return {k: v for k, v in kw.items() if v is not None}


def run_weightcache(path: Path, device: torch.device, args, opts: dict, ref: Reference | None) -> dict:
    if "intra_threads" not in opts:
        return _run_weightcache(path, device, args, opts, ref)
    before = torch.get_num_threads()  # the pipeline's copies use torch's intra-op threads
    torch.set_num_threads(opts["intra_threads"])
    try:
        return _run_weightcache(path, device, args, opts, ref)
    finally:
        torch.set_num_threads(before)


def _run_weightcache(path: Path, device: torch.device, args, opts: dict, ref: Reference | None) -> dict:
    t0 = time.perf_counter()
    src = SafetensorsSource(path, device=device, tp_rank=0, tp_size=args.tp, progress=False,
                            **source_kwargs(opts, args))
    if not opts.get("sendfile", 1):
        src._sendfile_ok = False  # the CPU path before sendfile: preadv through the arena's mapping
    src.prepare()  # as Daemon.load does: staging made while the arena is allocated
    arena = ArenaViews(src.describe(), device, not args.no_arena)
    sync(device)
    t1 = time.perf_counter()
    src.fill(arena.views, lambda n: None)
    sync(device)
    t2 = time.perf_counter()
    try:
        checked = ref.check(arena.views, "weightcache", args.verify) if ref is not None else 0
    finally:
        arena.close()
    modes = sorted(set(src.last_modes.values()))
    return {"bytes": src.nbytes, "seconds": t2 - t0, "fill_seconds": t2 - t1, "buffers": arena.kind,
            "verified": checked, "io": src.read.io, "modes": src.last_modes,
            "read_as": "+".join(modes) if modes else "slices"}


def run_instanttensor(files: list[Path], device: torch.device, args, ref: Reference | None, copy: bool) -> dict:
    """All files in one call. copy=True: tensors it allocates (checked afterwards); copy=False: its zero-copy
    views, each read and dropped (how fast it reads; weightcache-instanttensor checks that path)."""
    from instanttensor import safe_open

    got, n = {}, 0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with safe_open([str(f) for f in files], framework="pt", device=device.index, copy=copy) as f:
            for name, t in f.tensors():
                n += t.numel() * t.element_size()
                if copy:
                    got[name] = t
            backend = getattr(getattr(f, "backend", None), "name", "?")
    sync(device)
    dt = time.perf_counter() - t0
    checked = ref.check(got, "instanttensor", args.verify) if (ref is not None and copy) else 0
    note = "tensors it allocates" if copy else "zero-copy views, not kept"
    return {"bytes": n, "seconds": dt, "verified": checked, "note": f"backend {backend}; {note}"}


def run_fastsafetensors(files: list[Path], device: torch.device, args, ref: Reference | None) -> dict:
    from fastsafetensors import SafeTensorsFileLoader

    t0 = time.perf_counter()
    loader = SafeTensorsFileLoader(None, str(device), nogds=True)
    try:
        loader.add_filenames({0: [str(f) for f in files]})
        fb = loader.copy_files_to_device()
        try:
            got = {k: fb.get_tensor(k) for k in loader.get_keys()}
            n = sum(t.numel() * t.element_size() for t in got.values())
            sync(device)
            dt = time.perf_counter() - t0
            checked = ref.check(got, "fastsafetensors", args.verify) if ref is not None else 0
            del got
        finally:
            fb.close()
    finally:
        loader.close()
    return {"bytes": n, "seconds": dt, "verified": checked, "note": "nogds=True"}


def run_safetensors(files: list[Path], device: torch.device, args, ref: Reference | None) -> dict:
    from safetensors.torch import load_file

    dev = str(device) if device.type == "cuda" else "cpu"
    got = {}
    t0 = time.perf_counter()
    for f in files:
        got.update(load_file(str(f), device=dev))
    sync(device)
    dt = time.perf_counter() - t0
    n = sum(t.numel() * t.element_size() for t in got.values())
    checked = ref.check(got, "safetensors", args.verify) if ref is not None else 0
    note = "cpu: tensors are mmap-backed, pages read lazily" if device.type == "cpu" else ""
    return {"bytes": n, "seconds": dt, "verified": checked, "note": note}


def run_pinned_h2d(device: torch.device, nbytes: int = 4 << 30) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm up
    sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0, "note": "ceiling: one pinned buffer -> device"}


def run_memcpy(nbytes: int, fresh: bool) -> dict:
    """CPU ceilings: torch's (multi-threaded) copy of nbytes into a touched buffer, or into a new memfd
    block (the arena's first touch: page faults and zeroing included; allocation in `seconds` too)."""
    from weightcache.arena.host import HostBlock

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    t0 = time.perf_counter()
    block = None
    if fresh:
        block = HostBlock(nbytes)
        dst = block.tensor[:nbytes]
    else:
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.fill_(2)
        t0 = time.perf_counter()
    t1 = time.perf_counter()
    dst.copy_(src)
    t2 = time.perf_counter()
    del dst
    if block is not None:
        block.close()
    note = "into a new memfd block (first touch)" if fresh else "between two touched buffers"
    return {"bytes": nbytes, "seconds": t2 - t0, "fill_seconds": t2 - t1,
            "note": f"ceiling: {note}, {torch.get_num_threads()} threads"}


def summarize(name: str, runs: list[dict], group: str, opts: dict | None = None) -> dict:
    secs = [r["seconds"] for r in runs]
    best = min(runs, key=lambda r: r["seconds"])
    res = {"method": name, "group": group, **best, "seconds_all": secs, "seconds_first": secs[0],
           "seconds_median": statistics.median(secs), "gb": best["bytes"] / 1e9,
           "gb_per_s": best["bytes"] / 1e9 / best["seconds"],
           "gb_per_s_median": best["bytes"] / 1e9 / statistics.median(secs)}
    if "fill_seconds" in best:
        fills = [r["fill_seconds"] for r in runs]
        res["fill_seconds_all"] = fills
        res["fill_gb_per_s"] = best["bytes"] / 1e9 / min(fills)
        res["fill_gb_per_s_median"] = best["bytes"] / 1e9 / statistics.median(fills)
    if opts:
        res["options"] = opts
    return res


def importable(module: str) -> str:
    try:
        __import__(module)
        return ""
    except Exception as e:  # noqa: BLE001 - any import failure means skip
        return f"not importable: {type(e).__name__}: {e}"


def measure_rounds(cases: list[tuple], runs: int, device: torch.device, results: list, before=None) -> None:
    """Run each case once per round, round after round (so that a machine's slow moments hit every method
    alike); a case that fails is a row with its error and leaves the later rounds. cases: (name, group,
    runner, options)."""
    out: dict[str, list[dict]] = {c[0]: [] for c in cases}
    failed: dict[str, str] = {}
    for k in range(runs):
        if runs > 1:
            print(f" round {k + 1}/{runs}")
        for name, _, runner, _ in cases:
            if name in failed:
                continue
            try:
                extra = before() if before else {}
                r = runner()
                r.update(extra)
                out[name].append(r)
                cached = f"  (cached before: {r['resident_before']:.0%})" if "resident_before" in r else ""
                print(f"  {name:<44} {r['bytes'] / 1e9:7.2f} GB {r['seconds']:7.3f} s "
                      f"{r['bytes'] / 1e9 / r['seconds']:6.1f} GB/s{cached}")
            except Exception as e:  # noqa: BLE001 - a failing method is a row, not the end of the run
                failed[name] = f"{type(e).__name__}: {e}"
                print(f"  {name:<44} ERROR {failed[name]}")
            free(device)
    for name, group, _, opts in cases:
        if name in failed:
            results.append({"method": name, "group": group, "error": failed[name], "options": opts})
        else:
            results.append(summarize(name, out[name], group, opts))


def print_table(results: list[dict]) -> None:
    print()
    print(f"{'group':<8} {'method':<46} {'GB':>7} {'seconds':>8} {'GB/s':>6} {'median':>6} {'first':>6} "
          f"{'fill GB/s':>9}  notes")
    for r in results:
        if "gb" in r:
            note = r.get("note") or ""
            if "buffers" in r:
                note = f"{r['buffers']}, io={r['io']} (read as {r['read_as']}), verified {r['verified']} tensors"
            elif r.get("verified"):
                note += f"; verified {r['verified']} tensors"
            if "resident_before" in r:
                note += f"; cached before: {r['resident_before']:.0%}"
            fill = f"{r['fill_gb_per_s']:9.1f}" if "fill_gb_per_s" in r else f"{'':>9}"
            print(f"{r['group']:<8} {r['method']:<46} {r['gb']:7.2f} {r['seconds']:8.3f} {r['gb_per_s']:6.1f} "
                  f"{r['gb_per_s_median']:6.1f} {r['gb'] / r['seconds_first']:6.1f} {fill}  {note}")
        else:
            print(f"{r['group']:<8} {r['method']:<46} {'-':>7} {'-':>8} {'-':>6} {'-':>6} {'-':>6} {'-':>9}  "
                  f"{r.get('skipped') or r.get('error')}")


def verdict(results: list[dict]) -> dict:
    """The fastest weightcache configuration against InstantTensor, warm."""
    warm = [r for r in results if r.get("group") == "warm" and "gb_per_s" in r]
    ours = [r for r in warm if r["method"].startswith(("weightcache", "wc["))]
    it = [r for r in warm if r["method"] == "instanttensor"]
    out = {}
    if ours:
        best = max(ours, key=lambda r: r["gb_per_s"])
        out["fastest_weightcache"] = {"method": best["method"], "gb_per_s": round(best["gb_per_s"], 2),
                                      "options": best.get("options")}
        default = next((r for r in ours if r["method"] == "weightcache"), None)
        if default:
            out["default_gb_per_s"] = round(default["gb_per_s"], 2)
    if it:
        out["instanttensor_gb_per_s"] = round(it[0]["gb_per_s"], 2)
        if ours:
            out["fastest_vs_instanttensor"] = round(out["fastest_weightcache"]["gb_per_s"] / it[0]["gb_per_s"], 3)
            if "default_gb_per_s" in out:
                out["default_vs_instanttensor"] = round(out["default_gb_per_s"] / it[0]["gb_per_s"], 3)
    return out


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.environ.get("WC_BENCH_DIR", "/tmp/weightcache-bench"),
                   help="where to write the warm checkpoint (/dev/shm: tmpfs)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--size-gb", type=float, default=None, help="checkpoint size (default 16 on GPU, 0.5 on CPU)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=None, help="default: the source's (16, at most the cores)")
    p.add_argument("--chunk-mb", type=int, default=None, help="staging buffer / read size (source default 64)")
    p.add_argument("--tp", type=int, default=1, help="load rank 0 of this tensor-parallel size")
    p.add_argument("--runs", type=int, default=2, help="repeats per method (best, first and median reported)")
    p.add_argument("--methods", default=None,
                   help="comma list (default on CUDA: weightcache,weightcache-staged,weightcache-register,"
                        "weightcache-instanttensor,instanttensor,instanttensor-view,fastsafetensors,safetensors,h2d; "
                        "on CPU: weightcache,weightcache-mmap,safetensors,memcpy,memcpy-fresh)")
    p.add_argument("--sweep", default="", help='"h200" or "key=value,...;key=value,..." (see above)')
    p.add_argument("--cold-dir", default=None, help="a directory on a real disk for the cold rows")
    p.add_argument("--cold-gb", type=float, default=4.0)
    p.add_argument("--cold-methods", default="weightcache,weightcache-staged,weightcache-register,instanttensor,"
                                             "fastsafetensors")
    p.add_argument("--cold-runs", type=int, default=1)
    p.add_argument("--no-arena", action="store_true", help="fill torch.empty buffers instead of the arena")
    p.add_argument("--keep-pinned", action="store_true",
                   help="keep torch's cached pinned host memory between runs (staging buffers then come free)")
    p.add_argument("--verify", default="all", help="'all', a number of tensors (largest first), or 0")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoints again even if present")
    p.add_argument("--cleanup", action="store_true", help="delete the checkpoints afterwards")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.size_gb is None:
        args.size_gb = 16.0 if device.type == "cuda" else 0.5
    args.verify = None if args.verify == "all" else int(args.verify)
    global KEEP_PINNED
    KEEP_PINNED = args.keep_pinned
    if args.methods is None:
        args.methods = ("weightcache,weightcache-staged,weightcache-register,weightcache-instanttensor,instanttensor,"
                        "instanttensor-view,fastsafetensors,safetensors,h2d" if device.type == "cuda" else
                        "weightcache,weightcache-mmap,safetensors,memcpy,memcpy-fresh")
    specs = SWEEP_H200 if args.sweep == "h200" else [s for s in args.sweep.split(";") if s.strip()]
    try:
        sweep = [parse_spec(s) for s in specs]
    except ValueError as e:
        p.error(str(e))
    t_start = time.perf_counter()

    path = make_checkpoint(args.dir, args.size_gb, args.shard_gb, args.rewrite)
    files = weight_files(path)
    warm_page_cache(files)
    if device.type == "cuda":  # context, allocator and pinned memory up before anything is timed
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).to(device)
        sync(device)
    do_verify = args.verify is None or args.verify > 0
    ref = Reference(path, device, args.tp) if do_verify else None

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    nbytes = sum(f.stat().st_size for f in files)
    results: list[dict] = []

    def runner_for(m: str, where: Path, wfiles: list[Path], reference):
        if m == "weightcache":
            return lambda: run_weightcache(where, device, args, {}, reference)
        if m.startswith("weightcache-"):
            return lambda: run_weightcache(where, device, args, {"io": m.split("-", 1)[1]}, reference)
        return {
            "instanttensor": lambda: run_instanttensor(wfiles, device, args, reference, copy=True),
            "instanttensor-view": lambda: run_instanttensor(wfiles, device, args, reference, copy=False),
            "fastsafetensors": lambda: run_fastsafetensors(wfiles, device, args, reference),
            "safetensors": lambda: run_safetensors(wfiles, device, args, reference),
            "h2d": lambda: run_pinned_h2d(device),
            "memcpy": lambda: run_memcpy(nbytes, fresh=False),
            "memcpy-fresh": lambda: run_memcpy(nbytes, fresh=True),
        }.get(m)

    def skip_reason(m: str) -> str:
        if m in ("instanttensor", "instanttensor-view", "weightcache-instanttensor"):
            if device.type != "cuda":
                return "CUDA only"
            return importable("instanttensor")
        if m == "fastsafetensors":
            return importable("fastsafetensors")
        if m == "h2d" and device.type != "cuda":
            return "CUDA only"
        if m.startswith("memcpy") and device.type != "cpu":
            return "CPU ceiling"
        if m == "safetensors" and args.tp > 1:
            return "loads whole tensors only (tp=1)"
        if m.startswith("instanttensor") and args.tp > 1:
            return "loads whole tensors only (tp=1)"
        return ""

    print(f"\nwarm: {path} ({nbytes / 1e9:.2f} GB in {len(files)} files) -> {device}")
    cases = []
    for m in methods:
        run = runner_for(m, path, files, ref)
        if run is None:
            p.error(f"unknown method {m!r}")
        why = skip_reason(m)
        if why:
            results.append({"method": m, "group": "warm", "skipped": why})
            print(f"  {m:<44} skipped: {why}")
            continue
        cases.append((m, "warm", run, None))
    for opts in sweep:
        name = "wc[" + " ".join(f"{k}={v}" for k, v in opts.items()) + "]"
        cases.append((name, "warm", lambda o=opts: run_weightcache(path, device, args, o, ref), opts))
    measure_rounds(cases, args.runs, device, results)
    if ref is not None:
        ref.tensors.clear()
        free(device)

    cold_info = {}
    if args.cold_dir:
        cpath = make_checkpoint(args.cold_dir, args.cold_gb, args.shard_gb, args.rewrite)
        cfiles = weight_files(cpath)
        cref = Reference(cpath, device, args.tp) if do_verify else None
        probe = drop_page_cache(cfiles)
        cold_info = {"path": str(cpath), "bytes": sum(f.stat().st_size for f in cfiles), **probe}
        print(f"\ncold: {cpath} ({cold_info['bytes'] / 1e9:.2f} GB); page cache dropped by {probe['dropped_by']}, "
              f"{probe['resident_after_drop']:.0%} still cached")

        def before():
            d = drop_page_cache(cfiles)
            return {"resident_before": max(resident_fraction(f) for f in cfiles), "dropped_by": d["dropped_by"]}

        cases = []
        for m in [m.strip() for m in args.cold_methods.split(",") if m.strip()]:
            run = runner_for(m, cpath, cfiles, cref)
            why = "unknown method" if run is None else skip_reason(m)
            if why:
                results.append({"method": m, "group": "cold", "skipped": why})
                continue
            cases.append((m, "cold", run, None))
        measure_rounds(cases, args.cold_runs, device, results, before=before)
        warm_page_cache(cfiles)
        measure_rounds([("weightcache", "disk-warm", runner_for("weightcache", cpath, cfiles, cref), None)],
                       args.runs, device, results)
        if cref is not None:
            cref.tensors.clear()
            free(device)

    print_table(results)
    summary = verdict(results)
    if summary:
        print("\n" + json.dumps(summary))
    host = socket.gethostname().split(".")[0]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"load-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {}
    for mod in ("instanttensor", "fastsafetensors", "safetensors", "cuda.bindings"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[mod] = version(mod.replace(".", "-"))
    info = {
        "host": host,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "versions": versions,
        "checkpoint": {"path": str(path), "files": len(files), "bytes": nbytes},
        "cold": cold_info,
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "summary": summary,
        "results": results,
    }
    out.write_text(json.dumps(info, indent=2))
    print(f"\nwrote {out} ({info['wall_seconds']} s)")
    if args.cleanup:
        shutil.rmtree(path)
        if args.cold_dir:
            shutil.rmtree(cpath)
    return 0


if __name__ == "__main__":
    sys.exit(main())
