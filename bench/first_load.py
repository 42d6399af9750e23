"""First load, as a user starts it: a fresh `weightcache preload` per engine (transformers, vllm, safetensors) on
the same checkpoint, side by side with InstantTensor's first run in a fresh process, then (--restart) the same
preload SIGKILLed and started again. Per engine: seconds to READY, the load rate the READY line prints, where
the time went (imports, checks, hashing, daemon start, engine construction, load, pack), and the daemon's peak
device memory, sampled by the daemon and from outside (NVML), against its weights.

Each preload starts with an empty digest cache (XDG_CACHE_HOME of its own) and no custodian holding anything:
what a first start costs. The page cache is warm (the files were just written or read). The native parts (the
fill and digest loops, the CUDA digest kernel) are built once before the timed runs, as on a host where
weightcache has run before.

    python bench/first_load.py --dir /dev/shm/wcfl --size-gb 16 --restart            # one GPU
    python bench/first_load.py --dir /dev/shm/wcfl --size-gb 48 --engines transformers,vllm --no-instanttensor
    python bench/first_load.py --device cpu --size-gb 0.2 --engines transformers,safetensors   # anywhere

Writes bench/results/first-load-<device>-<size>gb.json (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from child_env import free_port, kill_and_reap, with_env  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
ENV = dict(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
           VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
INSTANTTENSOR = r"""
import json, sys, time, warnings
t0 = time.perf_counter()
import torch
from instanttensor import safe_open
torch.cuda.init(); torch.empty(1, device="cuda")
t1 = time.perf_counter()
n = 0
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with safe_open(sys.argv[1:], framework="pt", device=0, copy=True) as f:
        kept = {}
        for name, t in f.tensors():
            n += t.numel() * t.element_size()
            kept[name] = t
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"bytes": n, "load_seconds": t2 - t1, "imports_seconds": t1 - t0,
                  "peak_bytes": torch.cuda.max_memory_allocated()}))
"""


def env_with(**extra) -> dict:
    return with_env(ENV, **extra)


class Gpu:
    """Device memory in use, sampled from outside the daemon (NVML), every few ms while a run lasts."""

    def __init__(self, index: int = 0):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:  # noqa: BLE001 - no NVML: the daemon's own sample only
            self.why = str(e)
        self.peak = self.base = 0
        self._stop = threading.Event()

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) if self.handle else 0

    def start(self) -> None:
        if self.handle is None:
            return
        self.base = self.peak = self.used()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.005)

    def stop(self) -> int | None:
        if self.handle is None:
            return None
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


class Preload:
    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.cmd, self.log_path = cmd, log
        self.log = open(log, "w")
        self.t0_wall = time.time()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "weightcache.cli", "preload", *cmd], stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        self.ready_line = ""

    def wait_ready(self, timeout: float = 3600) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("weightcache READY"):
                self.ready_line = line.strip()
                return time.perf_counter() - self.t0
            if not line and self.proc.poll() is not None:
                break
        raise SystemExit(f"preload did not get ready; see {self.log_path}:\n{self.log_path.read_text()[-3000:]}")

    def status(self, port: int) -> list[dict]:
        import httpx

        return httpx.get(f"http://127.0.0.1:{port}/status", timeout=30).json()["daemons"]

    def pids(self) -> list[int]:
        import psutil

        try:
            return [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sigkill_all(self) -> None:
        kill_and_reap(self.proc, self.pids())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.sigkill_all()
        self.log.close()


def release_all(sdir: str) -> None:
    from weightcache.custodian.client import CustodianClient
    from weightcache.errors import WeightCacheError

    try:
        client = CustodianClient.connect(sdir, timeout=10)
    except WeightCacheError:
        return
    try:
        client.stop()
    except WeightCacheError:
        pass
    client.close()


def wait_unserved(sdir: str, n: int, timeout: float = 30) -> None:
    from weightcache.custodian.client import CustodianClient

    client = CustodianClient.connect(sdir)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = client.holdings().holdings
            if len(held) >= n and not any(h.served_by for h in held):
                return
            time.sleep(0.02)
    finally:
        client.close()


def log_times(log: Path, t0_wall: float) -> dict[str, float]:
    """Seconds after the process started at which the preload's log said what (first occurrence)."""
    marks = {"first log line": None, "hashing": None, "hashed": None, "daemons starting": None, "listening": None,
             "loaded": None}
    patterns = {"hashing": "hashing ", "hashed": "hashing the checkpoint: ", "daemons starting": "starting ",
                "listening": " listening on ", "loaded": " ready: "}
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0_wall
        if marks["first log line"] is None:
            marks["first log line"] = t
        for k, p in patterns.items():
            if marks[k] is None and p in line:
                marks[k] = t
        if "hashing the checkpoint: " in line:
            marks["hashed"] = t  # the meter's last line
    return {k: round(v, 3) for k, v in marks.items() if v is not None}


def build_native(work: Path, device: str) -> None:
    """Build the fill loop, the digest loop and (CUDA) the digest kernel once, untimed, as any earlier run of
    weightcache on the host would have: every timed preload finds them built, its digest cache still empty."""
    code = ("from weightcache.reader import native_fill; from weightcache.integrity import native; "
            "native_fill.library(); native.library()")
    if device == "cuda":
        code += "; from weightcache.integrity.cuda import prepare_kernel; prepare_kernel(0)"
    subprocess.run([sys.executable, "-c", code], env=env_with(WEIGHTCACHE_NATIVE_DIR=str(work / "native")),
                   check=False, timeout=300)


def run_engine(engine: str, model: Path, a, work: Path, gpu: Gpu) -> dict:
    sdir = tempfile.mkdtemp(prefix="fl-", dir="/tmp")
    cache = work / f"cache-{engine}"
    shutil.rmtree(cache, ignore_errors=True)
    port = free_port()
    if engine == "vllm":
        cmd = [str(model), "--engine", "vllm", "--dtype", "float16" if a.quant else "bfloat16", "--max-model-len", "1024",
               "--weight-cache-socket-dir", sdir, "--weight-cache-health-port", str(port)]
        if a.device == "cpu":
            cmd += ["--enforce-eager"]
    else:
        cmd = [str(model), "--engine", engine, "--device", a.device, "--weight-cache-socket-dir", sdir,
               "--weight-cache-health-port", str(port)]
    env = env_with(XDG_CACHE_HOME=cache, WEIGHTCACHE_NATIVE_DIR=str(work / "native"))
    out: dict = {"engine": engine, "command": "weightcache preload " + " ".join(cmd)}
    gpu.start()
    p = Preload(cmd, env, work / f"preload-{engine}.log")
    try:
        out["ready_seconds"] = round(p.wait_ready(), 3)
        out["external_peak_bytes"] = gpu.stop()
        out["ready_line"] = p.ready_line
        m = re.search(r"loaded in ([\d.]+) s \(([\d.]+) GB/s\)", p.ready_line)
        if m:
            out["ready_line_seconds"], out["ready_line_gbps"] = float(m.group(1)), float(m.group(2))
        st = p.status(port)[0]["status"]
        out.update(nbytes=st["nbytes"], load_seconds=round(st["load_seconds"], 3),
                   load_gbps=round(st["load_bytes_per_second"] / 1e9, 2),
                   daemon_peak_bytes=st["peak_device_bytes"], daemon_ready_seconds=round(st["ready_seconds"], 3),
                   phases={k: round(v, 3) for k, v in st.get("phases", {}).items()})
        out["log"] = log_times(p.log_path, p.t0_wall)
        for k in ("daemon_peak_bytes", "external_peak_bytes"):
            if out.get(k):
                out[k.replace("_bytes", "_x")] = round(out[k] / st["nbytes"], 3)
        if a.restart:
            n = len(p.status(port))
            p.sigkill_all()
            wait_unserved(sdir, n)
            again = Preload(cmd, env, work / f"restart-{engine}.log")
            out["restart_ready_seconds"] = round(again.wait_ready(), 3)
            text = again.log_path.read_text()
            out["restart_from_record"] = "restarting from preload-" in text
            out["restart_log"] = log_times(again.log_path, again.t0_wall)
            again.stop()
        else:
            p.stop()
    finally:
        if p.proc.poll() is None:
            p.sigkill_all()
        release_all(sdir)
        shutil.rmtree(sdir, ignore_errors=True)
    return out


def run_instanttensor(model: Path, env: dict) -> dict:
    files = [str(f) for f in sorted(model.glob("*.safetensors"))]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", INSTANTTENSOR, *files], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"engine": "instanttensor (first run, fresh process)", "error": r.stderr.strip().splitlines()[-1:]}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {"engine": "instanttensor (first run, fresh process)", "process_seconds": round(time.perf_counter() - t0, 3),
            "load_seconds": round(got["load_seconds"], 3), "imports_seconds": round(got["imports_seconds"], 3),
            "nbytes": got["bytes"], "load_gbps": round(got["bytes"] / got["load_seconds"] / 1e9, 2),
            "daemon_peak_x": round(got["peak_bytes"] / got["bytes"], 3)}


def make_checkpoint(root: Path, size_gb: float, sparse: bool = False, quant: str = "") -> Path:
    import torch

    from weightcache.testing.checkpoints import (
        estimate_llama_bytes,
        llama_config_for_bytes,
        make_llama_checkpoint,
    )
    from weightcache.testing.quantized import (
        gptq_llama_bytes,
        gptq_llama_shape_for_bytes,
        make_large_gptq_checkpoint,
    )

    path = root / f"llama-{size_gb:g}gb-{quant or ('sparse' if sparse else 'bf16')}"
    if (path / ".complete").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    if quant:
        bits = int(quant.removeprefix("gptq"))
        kw = gptq_llama_shape_for_bytes(int(size_gb * 1e9), bits=bits)
        print(f"writing a {gptq_llama_bytes(bits=bits, **kw) / 1e9:.2f} GB GPTQ {bits}-bit checkpoint to {path}",
              flush=True)
        make_large_gptq_checkpoint(path, bits=bits, **kw)
    else:
        kw = llama_config_for_bytes(int(size_gb * 1e9), torch.bfloat16)
        print(f"writing a {estimate_llama_bytes(dtype=torch.bfloat16, **kw) / 1e9:.2f} GB checkpoint to {path}",
              flush=True)
        make_llama_checkpoint(path, dtype=torch.bfloat16, max_shard_bytes=4 << 30, seed=0, sparse=sparse, **kw)
    (path / ".complete").touch()
    return path


def fault_in(model: Path) -> None:
    """Read a sparse checkpoint through once, untimed: the first read of a tmpfs hole through a mapping allocates
    and zeroes its page, which would otherwise fall on whichever engine runs first."""
    import mmap

    import numpy as np

    t0 = time.perf_counter()
    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            view[::mmap.PAGESIZE].sum()  # one byte of every page
            del view  # the mapping closes only once nothing exports it
            total += len(m)
    print(f"faulted in {total / 1e9:.1f} GB of the sparse checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)


def fmt(v, unit="") -> str:
    if v is None:
        return "-"
    return f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def print_table(rows: list[dict]) -> None:
    print("\n| engine | READY s | load s | GB/s (READY line) | peak x (daemon) | peak x (NVML) | restart READY s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | error: {r['error']} |")
            continue
        print(f"| {r['engine']} | {fmt(r.get('ready_seconds', r.get('process_seconds')))} | {fmt(r.get('load_seconds'))} | "
              f"{fmt(r.get('ready_line_gbps', r.get('load_gbps')))} | {fmt(r.get('daemon_peak_x'))} | "
              f"{fmt(r.get('external_peak_x'))} | {fmt(r.get('restart_ready_seconds'))} |")
    print("\nwhere the time to READY went (seconds after the process started; phases of the daemon's load):")
    for r in rows:
        if r.get("log"):
            print(f"  {r['engine']}: log {r['log']}; load phases {r.get('phases', {})}")
        if r.get("restart_log"):
            print(f"  {r['engine']} restart (from the record: {r.get('restart_from_record')}): {r['restart_log']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/wcfl")
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--engines", default="transformers,vllm,safetensors")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--restart", action="store_true", help="SIGKILL each preload and time its restart")
    ap.add_argument("--no-instanttensor", dest="instanttensor", action="store_false")
    ap.add_argument("--cleanup", action="store_true", help="remove the checkpoint afterwards")
    ap.add_argument("--sparse", action="store_true",
                    help="every weight zero, the files holes (memory at scale in no time; not for token checks)")
    ap.add_argument("--quant", default="", choices=("", "gptq4", "gptq8"),
                    help="a GPTQ checkpoint of that size instead (random packed weights; vLLM repacks it for Marlin)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quant and a.sparse:
        ap.error("--quant writes real values: leave out --sparse")
    if a.quant and "transformers" in a.engines.split(","):
        ap.error("--quant: transformers needs a GPTQ backend this bench does not bring; use --engines vllm,safetensors")
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    model = make_checkpoint(root, a.size_gb, a.sparse, a.quant)
    if a.sparse:
        fault_in(model)
    work = Path(tempfile.mkdtemp(prefix="first-load-"))
    gpu = Gpu() if a.device == "cuda" else Gpu.__new__(Gpu)
    if a.device != "cuda":
        gpu.handle, gpu.peak, gpu.base = None, 0, 0
    build_native(work, a.device)
    rows = []
    for engine in [e for e in a.engines.split(",") if e]:
        try:
            rows.append(run_engine(engine, model, a, work, gpu))
        except (SystemExit, Exception) as e:  # noqa: BLE001 - one engine's failure is a row, not the end
            rows.append({"engine": engine, "error": str(e)[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    if a.instanttensor and a.device == "cuda":
        rows.append(run_instanttensor(model, env_with()))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    out = Path(a.out or ROOT / "bench" / "results" / f"first-load-{a.device}-{a.size_gb:g}gb{'-sparse' * a.sparse}{'-' * bool(a.quant)}{a.quant}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M"), "size_gb": a.size_gb,
            "sparse": a.sparse, "quant": a.quant or None, "logs": str(work)}
    try:
        import torch

        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
            meta["gpu_bytes"] = torch.cuda.get_device_properties(0).total_memory
    except Exception:  # noqa: BLE001
        pass
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out}; logs in {work}")
    if a.cleanup:
        shutil.rmtree(model, ignore_errors=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
