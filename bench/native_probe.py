"""Where the native fill loop's time goes on a GPU: the default source into a weightcache arena as a daemon
loads it, with the loop's variants (windows made while the arena is allocated, while the fill plans, or in
turn; faulted in by threads or by the kernel; made before the clock starts, for the bound; copies to the
device or from the file left out to see each side alone), round after round, with InstantTensor in the same
rounds where it imports.

    python bench/native_probe.py --dir /dev/shm/wcload --size-gb 16 --runs 4

Prints a table (best and median GB/s, the loop's own timeline) and writes
bench/results/native-probe-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
import load  # noqa: E402
from weightcache.reader import cuda_fill, native_fill  # noqa: E402
from weightcache.sources.safetensors import SafetensorsSource  # noqa: E402

PREPARED, AT_FILL, PREMADE = "prepared", "at fill", "premade"
VARIANTS = {  # name: (when the windows are made, cuda_fill settings, extra loop flags, source options)
    "default": (PREPARED, {}, 0, {}),
    "made as the fill plans": (AT_FILL, {}, 0, {}),
    "made in turn": (AT_FILL, {"NATIVE_EARLY": False}, 0, {}),
    "faulted by the kernel": (PREPARED, {"WINDOW_FAULT_THREADS": 0}, 0, {}),
    "made before the clock": (PREMADE, {}, 0, {}),
    "6 x 16 MiB (the default before)": (PREPARED, {}, 0, {"windows": 6}),
    "device copies only": (PREPARED, {}, native_fill.SKIP_HOST_COPY, {}),
    "file copies only": (PREPARED, {}, native_fill.SKIP_DEVICE_COPY, {}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/wcload")
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--shard-gb", type=float, default=4)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--only", action="append", default=[], help="variant names (default: all)")
    ap.add_argument("--out", help="the JSON's path (default: bench/results/native-probe-<device>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("native_probe.py needs a CUDA device (the CPU path has no native loop: bench/load.py --device cpu)")
        return 2
    path = load.make_checkpoint(args.dir, args.size_gb, args.shard_gb, False)
    files = load.weight_files(path)
    load.warm_page_cache(files)
    device = torch.device("cuda", 0)
    torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).to(device)
    names = args.only or list(VARIANTS)
    has_it = not load.importable("instanttensor")

    marks: dict[str, float] = {}
    real_run = native_fill.run
    extra_flags = [0]

    def traced_run(*a, **k):
        k["flags"] = k.get("flags", 0) | extra_flags[0]
        marks["loop_in"] = time.perf_counter()
        try:
            return real_run(*a, **k)
        finally:
            marks["loop_out"] = time.perf_counter()

    native_fill.run = traced_run
    real_windows = native_fill.Windows
    made: list = []

    def traced_windows(*a, **k):
        w = real_windows(*a, **k)
        made.append({**w.seconds, "ready": time.perf_counter()})
        return w

    native_fill.Windows = traced_windows
    rows: dict[str, list[dict]] = {n: [] for n in [*names, *(["instanttensor"] if has_it else [])]}
    for k in range(args.runs):
        print(f" round {k + 1}/{args.runs}", flush=True)
        for name in names:
            when, settings, flags, opts = VARIANTS[name]
            saved = {key: getattr(cuda_fill, key) for key in settings}
            for key, v in settings.items():
                setattr(cuda_fill, key, v)
            extra_flags[0] = flags
            marks.clear()
            made.clear()
            try:
                t0 = time.perf_counter()
                src = SafetensorsSource(path, device=device, tp_rank=0, tp_size=1, progress=False, **opts)
                t1 = time.perf_counter()
                if when == PREMADE:
                    src.prepare()
                    src._prepared._thread.join()
                    t0 = time.perf_counter() - (t1 - t0)  # the source's set-up counted, the windows not
                    t1 = time.perf_counter()
                elif when == PREPARED:
                    src.prepare()
                arena = load.ArenaViews(src.describe(), device, True)
                torch.cuda.synchronize(device)
                t2 = time.perf_counter()
                src.fill(arena.views, lambda n: None)
                torch.cuda.synchronize(device)
                t3 = time.perf_counter()
                arena.close()
            finally:
                for key, v in saved.items():
                    setattr(cuda_fill, key, v)
                extra_flags[0] = 0
            r = {"seconds": t3 - t0, "source": t1 - t0, "arena": t2 - t1, "fill": t3 - t2,
                 "plan": marks.get("loop_in", t3) - t2, "after_loop": t3 - marks.get("loop_out", t3),
                 "loop": dict(native_fill.last_stats),
                 "windows": {k: v - t0 if k == "ready" else v for k, v in made[0].items()} if made else {}}
            rows[name].append(r)
            print(f"  {name:<22} {src.nbytes / r['seconds'] / 1e9:6.1f} GB/s  (fill {src.nbytes / r['fill'] / 1e9:5.1f}; "
                  f"source {r['source'] * 1e3:4.1f} ms, arena {r['arena'] * 1e3:4.1f}, plan {r['plan'] * 1e3:4.1f}, "
                  f"first queued {r['loop'].get('first_queued', 0) * 1e3:5.2f}, last {r['loop'].get('last_queued', 0) * 1e3:6.1f}, "
                  f"synced {r['loop'].get('synced', 0) * 1e3:6.1f}, waited {r['loop'].get('waited', 0) * 1e3:6.1f} "
                  f"(all threads), windows {', '.join(f'{a} {b * 1e3:.1f}' for a, b in r['windows'].items())})",
                  flush=True)
            load.free(device)
        if has_it:
            r = load.run_instanttensor(files, device, SimpleNamespace(verify=0), None, True)
            rows["instanttensor"].append({"seconds": r["seconds"]})
            print(f"  {'instanttensor':<22} {r['bytes'] / r['seconds'] / 1e9:6.1f} GB/s", flush=True)
            load.free(device)
    nbytes = src.nbytes
    table = []
    print(f"\n{'variant':<22} {'GB/s':>6} {'median':>6} {'fill':>6}  loop timeline (median, ms)")
    for name, rs in rows.items():
        secs = sorted(r["seconds"] for r in rs)
        row = {"variant": name, "gb_per_s": nbytes / secs[0] / 1e9,
               "gb_per_s_median": nbytes / statistics.median(secs) / 1e9, "runs": rs}
        line = f"{name:<22} {row['gb_per_s']:6.1f} {row['gb_per_s_median']:6.1f}"
        if "fill" in rs[0]:
            row["fill_gb_per_s"] = nbytes / min(r["fill"] for r in rs) / 1e9
            med = {key: statistics.median(r["loop"].get(key, 0) for r in rs) * (1 if key == "loads" else 1e3)
                   for key in native_fill.STATS}
            plan = statistics.median(r["plan"] for r in rs) * 1e3
            line += (f" {row['fill_gb_per_s']:6.1f}  plan {plan:.1f}, " +
                     ", ".join(f"{key} {v:.1f}" for key, v in med.items()))
        print(line)
        table.append(row)
    res = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"native-probe-{torch.cuda.get_device_name(0).split()[-1].lower()}.json")
    res.write_text(json.dumps({"bytes": nbytes, "rows": table}, indent=1))
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
