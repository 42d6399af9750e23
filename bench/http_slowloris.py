"""/health latency while slow clients hold the health port, side by side with no attack.

A health server (the supervisor's, over one ready daemon entry) runs in a process with a low RLIMIT_NOFILE;
N slow clients each send part of a request head, a byte now and then, and reconnect when closed. /health is
asked R times with no attack, then R times under it, on a raw socket (no client library in the timing).

    python bench/http_slowloris.py --nofile 1024 --clients 1100 --requests 200

Prints a table and writes bench/results/http-slowloris-<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from child_env import with_src_on_path  # noqa: E402
from test_http import SLOW_LORIS_SERVER, SlowLoris, _get  # noqa: E402


def timings(port: int, n: int, gap: float) -> tuple[list[float], int]:
    out, failed = [], 0
    for _ in range(n):
        t = time.perf_counter()
        try:
            ok = _get(port).startswith(b"HTTP/1.1 200")
        except OSError:
            ok = False
        if ok:
            out.append(time.perf_counter() - t)
        else:
            failed += 1
        time.sleep(gap)
    return out, failed


def summary(name: str, lat: list[float], failed: int, fds: int) -> dict:
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    return {"run": name, "ok": len(lat), "failed": failed, "p50_ms": statistics.median(lat) * 1e3 if lat else None,
            "p99_ms": q[98] * 1e3 if lat else None, "max_ms": max(lat) * 1e3 if lat else None, "server_fds": fds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nofile", type=int, default=1024)
    p.add_argument("--clients", type=int, default=1100)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--gap", type=float, default=0.02, help="seconds between /health requests")
    p.add_argument("--tag", default="cpu", help="names the results file")
    a = p.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SLOW_LORIS_SERVER.format(nofile=a.nofile)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=with_src_on_path())
    port, cap = map(int, server.stdout.readline().split())
    fds = lambda: len(os.listdir(f"/proc/{server.pid}/fd"))  # noqa: E731
    rows = []
    try:
        lat, failed = timings(port, a.requests, a.gap)
        rows.append(summary("no attack", lat, failed, fds()))
        attack = SlowLoris(port, a.clients)
        try:
            time.sleep(2.0)
            lat, failed = timings(port, a.requests, a.gap)
            rows.append(summary(f"{a.clients} slow clients", lat, failed, fds()))
        finally:
            attack.close()
    finally:
        server.stdin.close()
        server.wait(10)
    print(f"/health on a server with RLIMIT_NOFILE {a.nofile} (connection cap {cap}), {a.requests} requests each")
    print(f"{'run':<22} {'ok':>5} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'fds':>5}")
    for r in rows:
        ms = [f"{r[k]:8.2f}" if r[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p99_ms", "max_ms")]
        print(f"{r['run']:<22} {r['ok']:>5} {r['failed']:>6} {' '.join(ms)} {r['server_fds']:>5}")
    base, hit = rows[0]["p50_ms"], rows[1]["p50_ms"]
    if base and hit:
        print(f"p50 under attack / without: {hit / base:.1f}x")
    out = ROOT / "bench" / "results" / f"http-slowloris-{a.tag}.json"
    out.write_text(json.dumps({"nofile": a.nofile, "cap": cap, "clients": a.clients, "requests": a.requests,
                               "python": platform.python_version(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
