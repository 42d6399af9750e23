"""How to get file bytes into a fresh memfd block (the CPU arena): preadv through the block's mapping (page
faults; each page zeroed, then overwritten) vs sendfile into the memfd (the kernel writes whole pages), vs a
plain memcpy between touched buffers. One thread, interleaved trials, fill time only (the block is allocated
and fallocated before the clock starts).

    python bench/memfd_fill.py --size-mb 512 --trials 7   # -> bench/results/memfd-fill-<host>.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import time
from pathlib import Path


def fresh_block(n: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("wc-bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    os.posix_fallocate(fd, 0, n)
    return fd, mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def fill_preadv(src: int, block: int, mm: mmap.mmap, n: int, chunk: int) -> None:
    mv = memoryview(mm)
    done = 0
    while done < n:
        done += os.preadv(src, [mv[done : min(n, done + chunk)]], done)
    mv.release()


def fill_sendfile(src: int, block: int, mm: mmap.mmap, n: int, chunk: int) -> None:
    w = os.open(f"/proc/self/fd/{block}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < n:
            done += os.sendfile(w, src, done, min(n - done, chunk))
    finally:
        os.close(w)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--dir", default="/dev/shm", help="where the source file lives (tmpfs or a disk's page cache)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n, chunk = args.size_mb << 20, 64 << 20
    path = Path(args.dir) / f"wc-memfd-fill-{os.getpid()}"
    path.write_bytes(os.urandom(n))
    src = os.open(path, os.O_RDONLY)
    rates: dict[str, list[float]] = {"preadv": [], "sendfile": [], "memcpy": []}
    try:
        a, b = bytearray(os.pread(src, n, 0)), bytearray(n)
        for _ in range(args.trials):
            for name, how in (("preadv", fill_preadv), ("sendfile", fill_sendfile)):
                block, mm = fresh_block(n)
                t0 = time.perf_counter()
                how(src, block, mm, n, chunk)
                rates[name].append(n / (time.perf_counter() - t0) / 1e9)
                if mm[n - 64 : n] != a[n - 64 : n]:
                    raise AssertionError(f"{name} wrote wrong bytes")
                mm.close()
                os.close(block)
            t0 = time.perf_counter()
            b[:] = a
            rates["memcpy"].append(n / (time.perf_counter() - t0) / 1e9)
    finally:
        os.close(src)
        path.unlink()
    summary = {k: {"best_gb_per_s": round(max(v), 3), "median_gb_per_s": round(statistics.median(v), 3),
                   "all": [round(x, 3) for x in v]} for k, v in rates.items()}
    summary["sendfile_vs_preadv_median"] = round(statistics.median(rates["sendfile"]) /
                                                 statistics.median(rates["preadv"]), 2)
    for k, v in summary.items():
        print(k, v)
    host = socket.gethostname().split(".")[0]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"memfd-fill-{host}.json"
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    out.write_text(json.dumps({"host": host, "cpus": os.cpu_count(), "loadavg_at_end": load, "size_mb": args.size_mb,
                               "source_dir": args.dir, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                               "results": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
