"""What a daemon's CUDA start costs in a fresh process, step by step (a restart from the record pays these and
little else): the interpreter, importing cuda-bindings, cuInit, the device's UUID, retaining the primary
context, and importing the daemon's own modules. Each step timed in a new process, --runs times, under three
conditions: nothing else holds the GPU, another process holds only NVML open, another holds a CUDA context.

    python bench/cuda_start.py --runs 3      # -> bench/results/cuda-start-<gpu>.json, a table of medians
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = r"""
import json, time, sys
t = {"python": time.time() - float(sys.argv[1])}
def mark(name, t0):
    t[name] = time.perf_counter() - t0
t0 = time.perf_counter(); from cuda.bindings import driver as cu; mark("import cuda-bindings", t0)
t0 = time.perf_counter(); (err,) = cu.cuInit(0); assert err == 0, err; mark("cuInit", t0)
t0 = time.perf_counter(); err, dev = cu.cuDeviceGet(0); cu.cuDeviceGetUuid(dev); mark("device UUID", t0)
t0 = time.perf_counter(); err, ctx = cu.cuDevicePrimaryCtxRetain(dev); cu.cuCtxSetCurrent(ctx); mark("primary context", t0)
t0 = time.perf_counter(); import weightcache.daemon, weightcache.handover; mark("import the daemon", t0)
print(json.dumps(t))
"""
HOLD_NVML = ("import ctypes, sys; n = ctypes.CDLL('libnvidia-ml.so.1'); assert n.nvmlInit_v2() == 0; "
             "print('held', flush=True); sys.stdin.read()")
HOLD_CONTEXT = ("from cuda.bindings import driver as cu; import sys; cu.cuInit(0); e, d = cu.cuDeviceGet(0); "
                "e, c = cu.cuDevicePrimaryCtxRetain(d); cu.cuCtxSetCurrent(c); cu.cuMemAlloc(1 << 20); "
                "print('held', flush=True); sys.stdin.read()")


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def one() -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, repr(time.time())], capture_output=True, text=True, env=env(),
                         timeout=120)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def under(holder: str | None, runs: int) -> list[dict]:
    proc = None
    if holder:
        proc = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env())
        if proc.stdout.readline().strip() != "held":
            raise SystemExit(f"the holder failed: {holder}")
    try:
        return [one() for _ in range(runs)]
    finally:
        if proc is not None:
            proc.stdin.close()
            proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        persistence = subprocess.run(["nvidia-smi", "--query-gpu=name,persistence_mode", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        raise SystemExit("cuda_start.py: no nvidia-smi here: run it on a machine with an NVIDIA GPU") from None
    print(f"GPU, persistence mode: {persistence}")
    rows = {}
    for name, holder in (("nothing else holds the GPU", None), ("another process holds NVML", HOLD_NVML),
                         ("another process holds a CUDA context", HOLD_CONTEXT)):
        runs = under(holder, a.runs)
        rows[name] = {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
        rows[name]["total"] = round(sum(rows[name].values()), 4)
    steps = list(next(iter(rows.values())))
    print("| condition | " + " | ".join(steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[s]:.3f}" for s in steps) + " |")
    out = Path(a.out or ROOT / "bench" / "results" / "cuda-start.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": persistence, "runs": a.runs, "medians_s": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
