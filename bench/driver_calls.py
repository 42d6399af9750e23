"""What queueing one host-to-device copy costs the CPU: cuda-bindings' cuMemcpyHtoDAsync with its handles
made per call or once, and torch's event record (the pipeline queues ~800 copies per 16 GB).

    python bench/driver_calls.py [--calls 5000]

Prints microseconds per call and writes bench/results/driver-calls-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args(argv)
    from cuda.bindings import driver as cu

    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    handle = cu.CUstream(stream.cuda_stream)
    event = torch.cuda.Event()

    def per_call(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / args.calls * 1e6

    rows = {
        "cuMemcpyHtoDAsync, handles made per call": lambda: cu.cuMemcpyHtoDAsync(
            cu.CUdeviceptr(dev.data_ptr()), host.data_ptr(), 4096, cu.CUstream(stream.cuda_stream)),
        "cuMemcpyHtoDAsync, stream handle made once": lambda: cu.cuMemcpyHtoDAsync(
            cu.CUdeviceptr(dev.data_ptr()), host.data_ptr(), 4096, handle),
        "torch Event.record": lambda: event.record(stream),
    }
    out = []
    for name, fn in rows.items():
        us = per_call(fn)
        out.append({"call": name, "microseconds": us})
        print(f"  {name:48s} {us:7.2f} us")
    res = ROOT / "bench" / "results" / f"driver-calls-{torch.cuda.get_device_name(0).split()[-1].lower()}.json"
    res.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "calls": args.calls, "rows": out}, indent=2))
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
