"""Attach benchmark: weightcache map / copy vs legacy CUDA IPC vs safetensors, side by side in one run.

For each size, a state dict of ~1,000 bf16 tensors is held by a producer process; fresh engine processes then
take it (a) with weightcache attach (map), (b) weightcache attach (copy), (c) legacy CUDA IPC through
torch.multiprocessing.reductions (what vLLM's and SGLang's caches use), (d) safetensors.torch.load_file from a
warm page cache. Each engine reports the time to get every tensor and the device memory it added; the map engine
also times a bf16 matmul over attached vs native weights.

    python bench/attach.py --sizes-gb 1 16 64 --runs 3           # on a GPU machine
    python bench/attach.py --device cpu --sizes-gb 0.25 --runs 3  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import weightcache as wc  # noqa: E402
from weightcache.key import CacheKey
from weightcache.manifest import TensorMeta
from weightcache.sources import FillSource

ROWS_DTYPE = torch.bfloat16
METHODS = ("map", "copy", "legacy_ipc", "safetensors")
MATMUL_N = 8192


def tensor_shapes(total_bytes: int, n: int = 1000, device: str = "cuda") -> dict[str, list[int]]:
    cols = 4096
    rows = max(1, total_bytes // (n * cols * 2))
    shapes = {f"layers.{i}.weight": [rows, cols] for i in range(n)}
    if device == "cuda":
        shapes["matmul.weight"] = [MATMUL_N, MATMUL_N]
    return shapes


class RandomSource(FillSource):
    """Fills the arena with random values generated on its device (no 2x memory)."""

    def __init__(self, shapes):
        self.shapes = shapes

    def describe(self):
        return [TensorMeta(n, "bfloat16", s) for n, s in self.shapes.items()]

    def fill(self, views, progress):
        g = torch.Generator(device=next(iter(views.values())).device).manual_seed(0)
        for v in views.values():
            v.normal_(generator=g)
            progress(v.numel() * v.element_size())

    def key_fields(self):
        return {}


KEY = CacheKey(model="bench", content_digest="random")


# ---------------------------------------------------------------- producers (held in their own processes)

def produce_weightcache(sock: str, shapes_file: str, device: str, block_gb: float | None) -> None:
    shapes = json.loads(Path(shapes_file).read_text())
    extra = {"block_bytes": int(block_gb * 2**30)} if block_gb else {}
    daemon = wc.Daemon(sock, KEY, device=device, **extra)
    daemon.start()
    daemon.load(RandomSource(shapes))
    print("READY", flush=True)
    daemon.serve_forever()


def produce_legacy(path: str, shapes_file: str, device: str) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    shapes = json.loads(Path(shapes_file).read_text())
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {n: torch.empty(s, dtype=ROWS_DTYPE, device=device).normal_(generator=g) for n, s in shapes.items()}
    torch.cuda.synchronize()
    Path(path).write_bytes(pickle.dumps([(n, reduce_tensor(t)) for n, t in tensors.items()]))
    print("READY", flush=True)
    while True:
        time.sleep(3600)


def write_safetensors(path: str, shapes: dict[str, list[int]]) -> None:
    """Stream a safetensors file of random bf16 values (no model-sized buffer in memory)."""
    header, off = {}, 0
    for n, s in shapes.items():
        nbytes = 2 * s[0] * s[1]
        header[n] = {"dtype": "BF16", "shape": s, "data_offsets": [off, off + nbytes]}
        off += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    pool = torch.randn(32 << 20, dtype=ROWS_DTYPE).view(torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        left = off
        while left:
            k = min(left, len(pool))
            f.write(pool[:k])
            left -= k


# ---------------------------------------------------------------- engines (fresh process per run)

def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


def _matmul_tflops(w: torch.Tensor, iters: int = 30) -> float:
    x = torch.randn(MATMUL_N, MATMUL_N, dtype=w.dtype, device=w.device)
    for _ in range(5):
        x @ w
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        x @ w
    end.record()
    torch.cuda.synchronize()
    return 2 * MATMUL_N**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def engine(method: str, target: str, device: str, matmul: bool) -> dict:
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")  # context up before timing, as in a restarting engine
        import weightcache.arena.cuda  # noqa: F401 - an engine imports its loader at start-up
    before = _free(device)
    phases = {}
    t0 = time.perf_counter()
    if method in ("map", "copy"):
        att = wc.attach(target, expect=KEY, mode=method)
        tensors = att.tensors
        phases = att.timings
    elif method == "legacy_ipc":
        payload = pickle.loads(Path(target).read_bytes())
        tensors = {n: fn(*args) for n, (fn, args) in payload}
    elif method == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(target, device=device)
    else:
        raise ValueError(method)
    _sync(device)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "tensors": len(tensors), "added_bytes": before - _free(device), "phases": phases}
    if method == "map":  # the same attach again in this process: what part of the first was one-time cost
        again = wc.attach(target, expect=KEY, mode=method)
        out["again_phases"] = again.timings
        again.close()
    if matmul and device == "cuda" and "matmul.weight" in tensors:
        w = tensors["matmul.weight"]
        native = w.clone()
        mapped, cloned = [], []
        for _ in range(3):  # interleaved, so clocks and heat treat both alike
            mapped.append(_matmul_tflops(w))
            cloned.append(_matmul_tflops(native))
        out["matmul_tflops"] = statistics.median(mapped)
        out["matmul_native_tflops"] = statistics.median(cloned)
    return out


# ---------------------------------------------------------------- orchestration

def _spawn(role: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, "--role", role, *args], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "READY":
        p.kill()
        raise RuntimeError(f"{role} producer failed to start: {line!r}")
    return p


def _run_engine(method, target, device, matmul) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--role", "engine", "--method", method, "--target", target, "--device", device]
        + (["--matmul"] if matmul else []),
        capture_output=True, text=True, check=False,
    )
    if out.returncode:
        raise RuntimeError(f"engine {method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def bench_size(gb: float, runs: int, device: str, workdir: Path, safetensors_dir: Path | None,
               methods=METHODS, block_gb: float | None = None) -> list[dict]:
    shapes = tensor_shapes(int(gb * 1e9), device=device)
    shapes_file = workdir / "shapes.json"
    shapes_file.write_text(json.dumps(shapes))
    rows = []

    def record(method, results, nbytes):
        rows.append({
            "size_gb": gb, "method": method, "tensors": results[0]["tensors"], "bytes": nbytes,
            "seconds_median": _median(results, "seconds"), "seconds_all": [r["seconds"] for r in results],
            "added_bytes_median": _median(results, "added_bytes"),
            "matmul_tflops": _median(results, "matmul_tflops"),
            "matmul_native_tflops": _median(results, "matmul_native_tflops"),
            "phases_ms_median": {k: 1e3 * statistics.median(r["phases"][k] for r in results)
                                 for k in results[0]["phases"]},
            "phases_ms_all": [{k: 1e3 * v for k, v in r["phases"].items()} for r in results],
        })
        if "again_phases" in results[0]:
            rows[-1]["again_phases_ms_median"] = {k: 1e3 * statistics.median(r["again_phases"][k] for r in results)
                                                  for k in results[0]["again_phases"]}
            st = wc.query_status(sock)
            rows[-1]["daemon_attach_ms_mean"] = 1e3 * st.attach_seconds_sum / max(1, st.attach_seconds_count)
        phases = " ".join(f"{k}={v:.2f}" for k, v in rows[-1]["phases_ms_median"].items())
        if "again_phases_ms_median" in rows[-1]:
            phases += (f" | again total={rows[-1]['again_phases_ms_median']['total']:.2f}"
                       f" daemon={rows[-1]['daemon_attach_ms_mean']:.2f}")
        print(f"  {gb:>6} GB  {method:<12} {rows[-1]['seconds_median'] * 1e3:10.2f} ms  {phases}", flush=True)

    nbytes = sum(2 * s[0] * s[1] for s in shapes.values())
    sock = str(workdir / "b.sock")
    prod = _spawn("weightcache", "--target", sock, "--shapes", str(shapes_file), "--device", device,
                  *(["--block-gb", str(block_gb)] if block_gb else []))
    try:
        for method in [m for m in ("map", "copy") if m in methods]:
            record(method, [_run_engine(method, sock, device, method == "map") for _ in range(runs)], nbytes)
    finally:
        prod.terminate()
        prod.wait()
    if device == "cuda" and "legacy_ipc" in methods:
        ipc = str(workdir / "legacy.pkl")
        prod = _spawn("legacy", "--target", ipc, "--shapes", str(shapes_file), "--device", device)
        try:
            record("legacy_ipc", [_run_engine("legacy_ipc", ipc, device, False) for _ in range(runs)], nbytes)
        finally:
            prod.kill()
            prod.wait()
    if safetensors_dir is not None and "safetensors" in methods:
        st = safetensors_dir / f"bench-{gb}.safetensors"
        free = shutil.disk_usage(safetensors_dir).free
        if free < nbytes * 1.05:
            print(f"  safetensors at {gb} GB skipped: {free / 1e9:.0f} GB free in {safetensors_dir}", flush=True)
            return rows
        try:
            write_safetensors(str(st), shapes)
            with open(st, "rb") as f:  # warm the page cache
                while f.read(64 << 20):
                    pass
            record("safetensors", [_run_engine("safetensors", str(st), device, False) for _ in range(runs)], nbytes)
        except OSError as e:
            print(f"  safetensors at {gb} GB skipped: {e}", flush=True)
        finally:
            st.unlink(missing_ok=True)
    return rows


def print_table(rows) -> None:
    base = {(r["size_gb"]): r["seconds_median"] for r in rows if r["method"] == "map"}
    print(f"\n{'size':>8} {'method':<12} {'tensors':>8} {'median':>12} {'vs map':>9} {'added MiB':>10} {'matmul TF/s':>12}")
    for r in rows:
        ratio = r["seconds_median"] / base[r["size_gb"]] if base.get(r["size_gb"]) else float("nan")
        mm = f"{r['matmul_tflops']:.0f}/{r['matmul_native_tflops']:.0f}" if r["matmul_tflops"] else ""
        print(f"{r['size_gb']:>6} GB {r['method']:<12} {r['tensors']:>8} {r['seconds_median'] * 1e3:>9.2f} ms "
              f"{ratio:>8.1f}x {r['added_bytes_median'] / 2**20:>10.1f} {mm:>12}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--safetensors-dir", default=None,
                   help="where to write the safetensors file (default /dev/shm when it has room, else a temp dir)")
    p.add_argument("--no-safetensors", action="store_true")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--block-gb", type=float, default=None, help="the daemon's block size (default: the library's)")
    p.add_argument("--out", default=None)
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--matmul", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "weightcache":
        produce_weightcache(a.target, a.shapes, a.device, a.block_gb)
        return 0
    if a.role == "legacy":
        produce_legacy(a.target, a.shapes, a.device)
        return 0
    if a.role == "engine":
        print(json.dumps(engine(a.method, a.target, a.device, a.matmul)))
        return 0

    sizes = a.sizes_gb or ([1, 16, 64] if a.device == "cuda" else [0.25])
    st_dir = None
    if not a.no_safetensors:
        st_dir = Path(a.safetensors_dir) if a.safetensors_dir else max(
            (Path(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)),
            key=lambda d: shutil.disk_usage(d).free,
        )
    meta = {
        "host": socket.gethostname(), "device": a.device, "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(), "runs": a.runs,
        "date": time.strftime("%Y-%m-%d"), "block_gb": a.block_gb,
        "command": "python bench/attach.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(a.out or Path(__file__).parent / "results" / f"attach-{a.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="wcb", dir="/tmp") as work:
        for gb in sizes:
            print(f"size {gb} GB", flush=True)
            rows += bench_size(gb, a.runs, a.device, Path(work), st_dir, a.methods, a.block_gb)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))  # a cut-short run keeps its sizes
    print_table(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
