"""How fast resident bytes are verified: the digest kernel (NVRTC) over one arena block on the GPU, side by side
with a plain read of the same bytes (torch's int64 sum: about what the memory gives), per chunk size; the torch
fallback; and the native loop on the CPU. Interleaved trials, medians; the goal is <= 10 ms per 16 GB on an
H100/H200 (1.6 TB/s).

    python bench/verify.py                       # 16 GiB block on cuda:0 -> bench/results/verify-<host>.json
    python bench/verify.py --size-gb 4 --trials 9 --cpu-mb 1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from weightcache.integrity import algorithm, native  # noqa: E402
from weightcache.integrity import cuda as icuda  # noqa: E402

GOAL_MS_PER_16GB = 10.0


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def gpu_block(nbytes: int, index: int):
    """An arena block (VMM, as a daemon holds it) filled with random bytes; a plain torch buffer without
    cuda-bindings."""
    try:
        from weightcache.arena.cuda import CudaBlock

        block = CudaBlock(nbytes, index)
        t = block.tensor
    except Exception as e:  # noqa: BLE001 - bench: report and go on
        print(f"(no VMM block: {e}; a torch buffer instead)")
        block, t = None, torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    words = t[: nbytes - nbytes % 8].view(torch.int64)
    step = 1 << 27
    g = torch.Generator(device=t.device).manual_seed(0)
    for i in range(0, words.numel(), step):
        part = words[i:i + step]
        part.random_(generator=g)
    torch.cuda.synchronize(index)
    return block, t[:nbytes]


def bench_gpu(args, out: dict) -> None:
    index = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(index)
    nbytes = min(int(args.size_gb * 2**30), int(free * 0.8)) // (2 << 20) * (2 << 20)
    block, t = gpu_block(nbytes, index)
    sync = lambda: torch.cuda.synchronize(index)  # noqa: E731
    t0 = time.perf_counter()
    first = icuda.kernel_chunk_sums(t, algorithm.DEFAULT_CHUNK_BYTES)
    out["kernel_first_call_s"] = time.perf_counter() - t0  # NVRTC compile (or the disk cache) + module load
    check = icuda.torch_chunk_sums(t[: 64 << 20], algorithm.DEFAULT_CHUNK_BYTES)
    assert (first[: len(check)] == check).all(), "kernel and torch fallback disagree"
    words = t[: nbytes - nbytes % 8].view(torch.int64)
    chunks = [1 << 20, 4 << 20, 16 << 20]
    runs: dict[str, list[float]] = {"read (torch int64 sum)": []} | {f"digest {c >> 20} MiB chunks": [] for c in chunks}
    for _ in range(args.trials):
        runs["read (torch int64 sum)"].append(timed(lambda: words.sum(), sync))
        for c in chunks:
            runs[f"digest {c >> 20} MiB chunks"].append(timed(lambda c=c: icuda.kernel_chunk_sums(t, c), sync))
    small = t[: 1 << 30]
    fallback = [timed(lambda: icuda.torch_chunk_sums(small, algorithm.DEFAULT_CHUNK_BYTES), sync) for _ in range(3)]
    rows = {}
    for name, secs in runs.items():
        med = statistics.median(secs)
        rows[name] = {"nbytes": nbytes, "median_s": med, "best_s": min(secs), "gb_per_s": nbytes / med / 1e9,
                      "ms_per_16gb": med * 16e9 / nbytes * 1e3}
    med = statistics.median(fallback)
    rows["torch fallback (1 GiB)"] = {"nbytes": small.numel(), "median_s": med, "best_s": min(fallback),
                                      "gb_per_s": small.numel() / med / 1e9, "ms_per_16gb": med * 16e9 / small.numel() * 1e3}
    read = rows["read (torch int64 sum)"]["median_s"]
    for name, r in rows.items():
        if name.startswith("digest"):
            r["vs_read"] = r["median_s"] / read
    out["gpu"] = {"device": torch.cuda.get_device_name(index), "nbytes": nbytes, "trials": args.trials, "rows": rows,
                  "goal_ms_per_16gb": GOAL_MS_PER_16GB,
                  "goal_met": rows["digest 4 MiB chunks"]["ms_per_16gb"] <= GOAL_MS_PER_16GB}
    if block is not None:
        block.close()


def bench_cpu(args, out: dict) -> None:
    n = args.cpu_mb << 20
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    lib, why = native.library()
    rows = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        if lib is None:
            break
        secs = [timed(lambda th=threads: native.chunk_sums(data.ctypes.data, n, algorithm.DEFAULT_CHUNK_BYTES, th),
                      lambda: None) for _ in range(args.trials)]
        med = statistics.median(secs)
        rows[f"native, {threads} thread(s)"] = {"nbytes": n, "median_s": med, "gb_per_s": n / med / 1e9,
                                                "ms_per_16gb": med * 16e9 / n * 1e3}
    part = data[: 64 << 20]
    med = statistics.median([timed(lambda: algorithm.digests_numpy(part), lambda: None) for _ in range(3)])
    rows["numpy (64 MiB)"] = {"nbytes": part.nbytes, "median_s": med, "gb_per_s": part.nbytes / med / 1e9,
                              "ms_per_16gb": med * 16e9 / part.nbytes * 1e3}
    out["cpu"] = {"native": why or "built", "cpus": os.cpu_count(), "rows": rows}


def table(title: str, rows: dict) -> str:
    lines = [title, f"  {'what':<28} {'GB/s':>9} {'ms/16GB':>10} {'vs read':>8}"]
    for name, r in rows.items():
        vs = f"{r['vs_read']:.2f}x" if "vs_read" in r else ""
        lines.append(f"  {name:<28} {r['gb_per_s']:>9.1f} {r['ms_per_16gb']:>10.1f} {vs:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=16.0, help="GiB of the GPU block (capped at 80%% of free memory)")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--cpu-mb", type=int, default=512, help="MiB hashed on the CPU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out: dict = {"host": socket.gethostname(), "algorithm": algorithm.NAME, "torch": torch.__version__,
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if torch.cuda.is_available():
        bench_gpu(args, out)
        g = out["gpu"]
        print(table(f"GPU {g['device']}, {g['nbytes'] / 2**30:.1f} GiB block, {g['trials']} trials (medians); "
                    f"first call {out['kernel_first_call_s']:.2f} s", g["rows"]))
        print(f"  goal <= {GOAL_MS_PER_16GB:.0f} ms per 16 GB (4 MiB chunks): {'met' if g['goal_met'] else 'NOT met'}")
    else:
        print("no CUDA device: CPU only")
    bench_cpu(args, out)
    print(table(f"CPU ({out['cpu']['cpus']} cores), native loop {out['cpu']['native']}", out["cpu"]["rows"]))
    path = Path(args.out) if args.out else Path(__file__).parent / "results" / f"verify-{socket.gethostname()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
