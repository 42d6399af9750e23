"""The cache outlives its daemon: how fast a rank (or a whole `weightcache preload`) is back, side by side with
a fresh load of the same model.

For each random-weight Llama-shaped checkpoint (written once into --ckpt-dir and reused, page cache warm):

  fresh         `weightcache preload` with nothing held: start to READY (reads the checkpoint)
  preload       the same command again after SIGKILL of the supervisor and every daemon, the custodian holding
                the weights: start to READY (no checkpoint read, no load)
  daemon        SIGKILL of one daemon after READY: kill to /health 200 again (a new process takes the held
                weights), and the new daemon's own time from binding its socket to ready

    python bench/custodian.py --models 8b --runs 3 --ckpt-dir /dev/shm/wcb      # H200: ~16 GB, cuda:0
    python bench/custodian.py --models tiny --runs 2 --device cpu --ckpt-dir /tmp/wcb   # anywhere

Writes bench/results/custodian-<device>.json (rows merged by model) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from child_env import free_port, kill_and_reap, with_src_on_path  # noqa: E402
from restart import digest_and_warm, ensure_checkpoint, preset_shapes, warm_page_cache  # noqa: E402


def get(url: str, timeout: float = 5.0):
    import httpx

    return httpx.get(url, timeout=timeout)


class Preload:
    def __init__(self, model: Path, a, sdir: str, port: int, log: Path):
        self.log = open(log, "a")
        cmd = [sys.executable, "-m", "weightcache.cli", "preload", str(model), "--device", a.kind, "-tp", str(a.tp),
               "--dtype", a.dtype, "--weight-cache-socket-dir", sdir, "--weight-cache-health-port", str(port),
               "--weight-cache-status-details"]  # /status with the daemons' pids
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=with_src_on_path(), start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 3600) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("weightcache READY"):
                return time.perf_counter() - self.t0
            if not line and self.proc.poll() is not None:
                break
        raise SystemExit(f"preload did not get ready; see {self.log.name}")

    def daemons(self) -> list[dict]:
        return get(self.url + "/status").json()["daemons"]

    def sigkill_all(self) -> None:
        import psutil

        kill_and_reap(self.proc, [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def _proc(pid):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def release_all(sdir: str) -> None:
    """Stop the custodian (it frees everything it holds): the next preload starts from nothing."""
    from weightcache.custodian.client import CustodianClient
    from weightcache.errors import WeightCacheError

    try:
        client = CustodianClient.connect(sdir)
    except WeightCacheError:
        return
    pid = client.pid
    client.stop()
    client.close()
    proc = _proc(pid)
    if proc is not None:
        proc.wait(30)


def daemon_kill(p: Preload) -> dict:
    """SIGKILL rank 0's daemon; time until /health is 200 again with a new, ready daemon."""
    victim = next(d for d in p.daemons() if d["rank"] == 0)
    t0 = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    while True:
        try:
            healthy = get(p.url + "/health").status_code == 200
            d = next(d for d in p.daemons() if d["rank"] == 0)
        except Exception:
            time.sleep(0.01)
            continue
        st = d.get("status") or {}
        if healthy and d["pid"] != victim["pid"] and st.get("state") == "ready":
            return {"seconds": time.perf_counter() - t0, "ready_seconds": st["ready_seconds"],
                    "adopt_seconds": st["load_seconds"], "adopted": st["adopted"]}
        time.sleep(0.01)


def bench_model(name: str, a, work: Path) -> list[dict]:
    path, info = ensure_checkpoint(Path(a.ckpt_dir), name, getattr(torch, a.dtype))
    digest_and_warm(path)
    sdir = tempfile.mkdtemp(prefix="wcc", dir="/tmp")
    os.chmod(sdir, 0o700)
    rows = {"fresh": [], "preload": [], "daemon": [], "daemon_ready": [], "fresh_load": []}
    try:
        for run in range(a.runs):
            release_all(sdir)
            warm_page_cache(path)
            p = Preload(path, a, sdir, free_port(), work / f"{name}.log")
            rows["fresh"].append(p.wait_ready())
            rows["fresh_load"].append(max(d["status"]["load_seconds"] for d in p.daemons()))
            k = daemon_kill(p)
            assert k["adopted"], k
            rows["daemon"].append(k["seconds"])
            rows["daemon_ready"].append(k["ready_seconds"])
            p.sigkill_all()
            again = Preload(path, a, sdir, free_port(), work / f"{name}.log")
            rows["preload"].append(again.wait_ready())
            assert all(d["status"]["adopted"] for d in again.daemons())
            again.stop()
            print(f"[{name}] run {run + 1}: fresh {rows['fresh'][-1]:.2f} s (load {rows['fresh_load'][-1]:.2f} s), "
                  f"preload restart {rows['preload'][-1]:.2f} s, daemon back in {rows['daemon'][-1]:.2f} s "
                  f"(socket to ready {rows['daemon_ready'][-1] * 1e3:.1f} ms)", flush=True)
    finally:
        release_all(sdir)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return [{"model": name, "bytes": info["bytes"], "tp": a.tp, "runs": a.runs, **{f"{k}_s": v for k, v in med.items()},
             "all": rows, "restart_vs_fresh": med["fresh"] / med["preload"]}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help="presets (tiny, 8b, 32b) or sizes like 24gb")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--ckpt-dir", required=True, help="where checkpoints are written once and reused")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.kind = a.device
    a.dtype = a.dtype or ("bfloat16" if a.kind == "cuda" else "float32")
    models = a.models or (["8b"] if a.kind == "cuda" else ["tiny"])
    for m in models:
        preset_shapes(m)
    os.environ.setdefault("XDG_CACHE_HOME", str(Path(a.ckpt_dir) / ".cache"))
    out = Path(a.out or ROOT / "bench" / "results" / f"custodian-{a.kind}.json")
    meta = {"host": socket.gethostname(), "device": a.kind, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if a.kind == "cuda" else platform.processor(),
            "dtype": a.dtype, "date": time.strftime("%Y-%m-%d"),
            "command": "python bench/custodian.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    result = {"meta": meta, "rows": []}
    if out.exists():
        result["rows"] = [r for r in json.loads(out.read_text()).get("rows", []) if r["model"] not in models]
    with tempfile.TemporaryDirectory(prefix="wcc", dir="/tmp") as work:
        for m in models:
            result["rows"] += bench_model(m, a, Path(work))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
    print("\n| model | size | fresh preload to READY (load) | preload restart to READY | daemon killed to /health 200 "
          "(socket to ready) | fresh / restart |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        print(f"| {r['model']} (tp {r['tp']}) | {r['bytes'] / 1e9:.1f} GB | {r['fresh_s']:.2f} s ({r['fresh_load_s']:.2f} s) | "
              f"{r['preload_s']:.2f} s | {r['daemon_s']:.2f} s ({r['daemon_ready_s'] * 1e3:.1f} ms) | "
              f"{r['restart_vs_fresh']:.1f}x |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
