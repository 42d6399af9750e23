"""Checkpoint hashing from the page cache, side by side: the digest weightcache uses (a BLAKE3 tree over 16 MiB
chunks, read with preads, one pool over files and chunks) against the alternatives, per thread count.

  sha256-file        SHA-256 of each file, one thread a file (the digest before key ABI 2)
  blake3-mmap        standard BLAKE3 of each file (`update_mmap`, `max_threads`), files one after another
  tree-blake3-pread  weightcache's digest: BLAKE3 leaves, 1 MiB preads (a file cut short gives an error)
  tree-blake3-mmap   the same tree, leaves hashed straight from mmap (no copy; a file cut short: SIGBUS)
  tree-sha256-pread  the tree with SHA-256 leaves (the fallback without the blake3 package)
  tree-blake3-process  weightcache's digest in a process of its own, as preload runs it (its start included)

GB/s is wall-clock (best of --reps); "GB/cpu-s" is bytes over the process's CPU seconds (the rate per busy
core, which other load on the machine barely changes) and "cores used" the CPU seconds over the wall time: on
a shared machine, a thread count that gets no more cores shows there, not as a slower hash.
With --with-load, a CPU "load" (L threads copying the files into one buffer, as the CPU fill does) runs
alone and then beside the hash at each --load-threads/--nice setting: its slowdown is the cost of the overlap.
With --busy-main, a Python thread holds the GIL beside every run, as a starting preload's main thread does: the
in-process hash waits for the GIL at every read, the hashing process does not.

    python bench/hash.py                                   # 4 files x 512 MiB in /dev/shm, 1..cores threads
    python bench/hash.py --files 8 --file-mb 2048 --threads 1 2 4 8 16 --with-load --load-threads 8

Prints a table; writes bench/results/hash-<cores>core.json (or --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from weightcache import digests as dg  # noqa: E402


def make_files(folder: Path, n: int, size: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"model-{i:05d}.safetensors"
        if not p.exists() or p.stat().st_size != size:
            with open(p, "wb") as f:
                left = size
                while left:
                    block = os.urandom(min(left, 64 << 20))
                    f.write(block)
                    left -= len(block)
        paths.append(p)
    for p in paths:  # into the page cache
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return paths


def sha256_file(paths: list[Path], threads: int) -> None:
    def one(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        return h.hexdigest()

    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        list(pool.map(one, paths))


def blake3_mmap(paths: list[Path], threads: int) -> None:
    for p in paths:
        blake3.blake3(max_threads=threads).update_mmap(p)


def tree(algo: str):
    def run(paths: list[Path], threads: int) -> None:
        files = [dg._File(p, p.stat().st_size) for p in paths]
        dg._hash_files(files, algo, threads, 0, dg._never)

    return run


def tree_mmap(paths: list[Path], threads: int) -> None:
    tasks = [(p, c) for p in paths for c in range(-(-p.stat().st_size // dg.CHUNK))]

    def leaf(task) -> bytes:
        p, c = task
        size = p.stat().st_size
        length = min(dg.CHUNK, size - c * dg.CHUNK)
        with open(p, "rb") as f, mmap.mmap(f.fileno(), length, offset=c * dg.CHUNK, prot=mmap.PROT_READ) as m:
            return blake3.blake3(memoryview(m)).digest()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(leaf, tasks))


def tree_process(paths: list[Path], threads: int) -> None:
    """What preload runs: the tree hash in a process of its own (`start_checkpoint_digest(in_a_process=True)`),
    with an empty digest cache."""
    with tempfile.TemporaryDirectory() as cache:
        before = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = cache  # the hashing process's digest cache: nothing remembered
        try:
            dg.start_checkpoint_digest(paths[0].parent, threads=threads, in_a_process=True).result()
        finally:
            if before is None:
                del os.environ["XDG_CACHE_HOME"]
            else:
                os.environ["XDG_CACHE_HOME"] = before


VARIANTS = {
    "sha256-file": sha256_file,
    "blake3-mmap": blake3_mmap,
    "tree-blake3-pread": tree("blake3"),
    "tree-blake3-process": tree_process,
    "tree-blake3-mmap": tree_mmap,
    "tree-sha256-pread": tree("sha256"),
}


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system  # a hashing process's, once reaped


def busy_python(stop: threading.Event) -> None:
    """A main thread that holds the GIL as a starting preload's does (imports, set-up)."""
    while not stop.is_set():
        sum(range(1000))


def measure(fn, paths, threads: int, reps: int, nbytes: int, busy: bool = False) -> dict:
    walls, cpus = [], []
    for _ in range(reps):
        stop = threading.Event()
        if busy:
            threading.Thread(target=busy_python, args=(stop,), daemon=True).start()
        c0, t0 = cpu_seconds(), time.perf_counter()
        try:
            fn(paths, threads)
        finally:
            stop.set()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
    best = min(walls)
    return {"threads": threads, "best_gbs": nbytes / best / 1e9, "median_gbs": nbytes / statistics.median(walls) / 1e9,
            "gb_per_cpu_s": nbytes / statistics.median(cpus) / 1e9,
            "cores_used": statistics.median(cpus) / statistics.median(walls), "walls_s": walls, "cpu_s": cpus}


class Load:
    """A stand-in for the CPU fill: `threads` threads copy the files into one buffer with 8 MiB preads."""

    def __init__(self, paths: list[Path], threads: int):
        self.paths, self.threads = paths, threads
        self.buf = bytearray(sum(p.stat().st_size for p in paths))

    def run(self) -> float:
        view = memoryview(self.buf)
        jobs, base = [], 0
        for p in self.paths:
            size = p.stat().st_size
            jobs += [(p, off, base + off, min(8 << 20, size - off)) for off in range(0, size, 8 << 20)]
            base += size
        it = iter(jobs)
        lock = threading.Lock()

        def work():
            fds = {}
            while True:
                with lock:
                    job = next(it, None)
                if job is None:
                    break
                p, off, at, n = job
                fd = fds.get(p) or fds.setdefault(p, os.open(p, os.O_RDONLY))
                os.preadv(fd, [view[at:at + n]], off)
            for fd in fds.values():
                os.close(fd)

        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(self.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return len(self.buf) / (time.perf_counter() - t0) / 1e9


def with_load(paths, nbytes, a) -> list[dict]:
    load = Load(paths, a.load_threads)
    alone = statistics.median(load.run() for _ in range(a.reps))
    rows = [{"hash_threads": 0, "nice": 0, "load_gbs": alone, "load_ratio": 1.0, "hash_gbs": None}]
    for threads in a.threads:
        for nice in a.nice:
            rates, hashes = [], []
            for _ in range(a.reps):
                files = [dg._File(p, p.stat().st_size) for p in paths]

                def hash_timed(files=files, threads=threads, nice=nice, hashes=hashes):
                    t0 = time.perf_counter()
                    dg._hash_files(files, "blake3", threads, nice, dg._never)
                    hashes.append(nbytes / (time.perf_counter() - t0) / 1e9)

                hasher = threading.Thread(target=hash_timed)
                hasher.start()
                rates.append(load.run())
                hasher.join()
            rate = statistics.median(rates)
            rows.append({"hash_threads": threads, "nice": nice, "load_gbs": rate, "load_ratio": rate / alone,
                         "hash_gbs": statistics.median(hashes)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm/wc-hash-bench", help="where the files are written (kept)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-mb", type=int, default=512)
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1, 2, 4, ... up to the cores")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--busy-main", action="store_true",
                    help="a Python thread holds the GIL beside every run, as a starting preload's main thread does")
    ap.add_argument("--with-load", action="store_true", help="also measure a CPU load's slowdown beside hashing")
    ap.add_argument("--load-threads", type=int, default=2)
    ap.add_argument("--nice", type=int, nargs="+", default=[0, 10])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cores = dg.default_threads()
    if a.threads is None:
        a.threads = sorted({1, *[2**i for i in range(1, 8) if 2**i <= cores], cores})
    paths = make_files(Path(a.dir), a.files, a.file_mb << 20)
    load_before = os.getloadavg()
    nbytes = sum(p.stat().st_size for p in paths)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"{a.files} file(s) x {a.file_mb} MiB in {a.dir}, {cores} core(s): {cpu}; blake3 {blake3.__version__}")
    print(f"{'variant':20s} {'threads':>7s} {'best GB/s':>10s} {'median':>8s} {'GB/cpu-s':>9s} {'cores used':>10s} "
          f"{'x 1 thread':>10s}")
    rows = []
    for name in a.variants:
        first = None
        for t in a.threads:
            r = {"variant": name, "busy_main": a.busy_main,
                 **measure(VARIANTS[name], paths, t, a.reps, nbytes, a.busy_main)}
            first = first or r["best_gbs"]
            r["scaling"] = r["best_gbs"] / first
            rows.append(r)
            print(f"{name:20s} {t:7d} {r['best_gbs']:10.2f} {r['median_gbs']:8.2f} {r['gb_per_cpu_s']:9.2f} "
                  f"{r['cores_used']:10.2f} {r['scaling']:10.2f}")
    result = {"cpu": cpu, "cores": cores, "loadavg": [load_before, os.getloadavg()], "kernel": platform.release(),
              "python": platform.python_version(), "blake3": blake3.__version__, "dir": a.dir, "files": a.files,
              "file_bytes": a.file_mb << 20, "reps": a.reps, "chunk": dg.CHUNK, "read": dg.READ, "rows": rows}
    if a.with_load:
        print(f"\nload: {a.load_threads} thread(s) copying the files into one buffer, beside the tree hash")
        print(f"{'hash threads':>12s} {'nice':>5s} {'load GB/s':>10s} {'x alone':>8s} {'hash GB/s':>10s}")
        result["with_load"] = with_load(paths, nbytes, a)
        for r in result["with_load"]:
            h = "-" if r["hash_gbs"] is None else f"{r['hash_gbs']:.2f}"
            print(f"{r['hash_threads']:12d} {r['nice']:5d} {r['load_gbs']:10.2f} {r['load_ratio']:8.2f} {h:>10s}")
    out = Path(a.out or ROOT / "bench" / "results" / f"hash-{cores}core.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
