"""A vLLM server's restart, as its user waits for it: `vllm serve` from process start to /health 200 and to the first
completion, loading from disk vs attaching from `weightcache preload --engine vllm` (and, with --warm, started
through `weightcache run` from a warm interpreter), vLLM's defaults (torch.compile + CUDA graphs) unless --eager.

Phases come from the server's own log lines, timed as they arrive: imports (until vLLM's first line), engine-core
start, the weight phase (vLLM's "Model loading took"), torch.compile (its cache is warm after the first run),
KV-cache profiling and allocation, CUDA graph capture, engine ready, API up, /health 200, first completion. Each
mode runs --runs times, alternating; every run must generate the same tokens.

    python bench/vllm_restart.py --model /dev/shm/wcvr/llama-16gb --runs 2 --modes disk,attach,attach-warm

Writes bench/results/vllm-restart-<device>.json (--out) and prints a table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from child_env import free_port, with_env  # noqa: E402

ENV = dict(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_USE_FLASHINFER_SAMPLER="0",
           PYTHONUNBUFFERED="1")
# (phase, the log text that ends it), in the order a start goes through them
MARKS = [
    ("imports", re.compile(r"vLLM API server version|non-default args")),
    ("engine core up", re.compile(r"Initializing a V1 LLM engine|EngineCore")),
    ("weights", re.compile(r"Model loading took")),
    ("compile", re.compile(r"torch\.compile takes|Directly load the compiled graph|Compiling a graph")),
    ("kv cache", re.compile(r"Available KV cache memory|GPU KV cache size")),
    ("cuda graphs", re.compile(r"Graph capturing finished")),
    ("engine ready", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("api up", re.compile(r"Application startup complete")),
]
LOAD_SECONDS = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")
PROMPT = "The weight cache keeps the model"


def env_with(**extra) -> dict:
    return with_env(ENV, **extra)


class Server:
    """One `vllm serve` process; its output lines timed as they arrive."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "w")
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def phases(self) -> dict[str, float]:
        out = {}
        for name, pat in MARKS:
            hit = next((t for t, line in self.lines if pat.search(line)), None)
            if hit is not None:
                out[name] = round(hit, 3)
        for _, line in self.lines:
            m = LOAD_SECONDS.search(line)
            if m:
                out["vllm model load s"] = float(m.group(2))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def wait_health(port: int, srv: Server, timeout: float) -> float:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {srv.proc.returncode}: "
                               + "\n".join(line for _, line in srv.lines[-30:]))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return time.perf_counter() - srv.t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError("no /health 200 in time")


def complete(port: int, model: str, tokens: int) -> tuple[float, str]:
    import httpx

    t = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                   json={"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["choices"][0]["text"]


def serve_cmd(a, port: int, mode: str, sdir: str) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model, "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", str(a.max_model_len), "--served-model-name", "m",
           "--gpu-memory-utilization", str(a.gpu_util)]
    if a.eager:
        cmd.append("--enforce-eager")
    if mode.startswith("attach"):
        cmd += ["--load-format", "weightcache", "--model-loader-extra-config", json.dumps({"socket_dir": sdir})]
    if mode.endswith("-warm"):
        cmd = [sys.executable, "-m", "weightcache.cli", "run", "--", *cmd]
    return cmd


def start_preload(a, sdir: str, work: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", a.model, "--dtype", "bfloat16",
           "--max-model-len", str(a.max_model_len), "--weight-cache-socket-dir", sdir]
    if a.eager:
        cmd.append("--enforce-eager")
    if "attach-warm" in a.modes:
        cmd.append("--warm-engine")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(work / "preload.log", "w"), text=True,
                            env=env_with(), start_new_session=True)
    t0 = time.perf_counter()
    for line in proc.stdout:
        if line.startswith("weightcache READY"):
            proc.ready = {"seconds": round(time.perf_counter() - t0, 3), "line": line.strip()}
            print(f"preload READY in {proc.ready['seconds']:.1f} s: {line.strip()}", flush=True)
            return proc
    raise SystemExit(f"preload failed: {(work / 'preload.log').read_text()[-3000:]}")


def one_run(a, mode: str, sdir: str, work: Path, k: int) -> dict:
    port = free_port()
    srv = Server(serve_cmd(a, port, mode, sdir), env_with(), work / f"serve-{mode}-{k}.log")
    try:
        health = wait_health(port, srv, a.timeout)
        first, text = complete(port, "m", a.tokens)
        out = {"mode": mode, "run": k, "health_seconds": round(health, 3),
               "first_completion_seconds": round(time.perf_counter() - srv.t0, 3),
               "completion_seconds": round(first, 3), "text": text, **srv.phases()}
    finally:
        srv.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="disk,attach")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--warmup", action="store_true",
                    help="one untimed start from disk first (fills vLLM's compile cache; every timed start then finds it warm)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    work = Path(tempfile.mkdtemp(prefix="vllm-restart-"))
    sdir = tempfile.mkdtemp(prefix="vr-", dir="/tmp")
    preload = start_preload(a, sdir, work) if any(m.startswith("attach") for m in modes) else None
    runs = []
    try:
        if a.warmup:
            w = one_run(a, "disk", sdir, work, -1)
            print(f"warm-up (not timed): {json.dumps(w)}", flush=True)
        for k in range(a.runs):
            for mode in modes:
                r = one_run(a, mode, sdir, work, k)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if preload is not None:
            os.killpg(preload.pid, signal.SIGTERM)
            preload.wait(120)
    texts = {r["text"] for r in runs}
    keys = ["imports", "engine core up", "weights", "vllm model load s", "compile", "kv cache", "cuda graphs",
            "engine ready", "api up", "health_seconds", "first_completion_seconds"]
    table = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        table[mode] = {k: round(statistics.median(r[k] for r in mine if k in r), 3)
                       for k in keys if any(k in r for r in mine)}
    print("\nmedians, seconds after the process started (vLLM's own model-load seconds apart):")
    print("| mode | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for mode, row in table.items():
        print(f"| {mode} | " + " | ".join(str(row.get(k, "-")) for k in keys) + " |")
    print(f"same completion text in every run: {len(texts) == 1}")
    out = Path(a.out or ROOT / "bench" / "results" / "vllm-restart.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "eager": a.eager, "runs": runs, "medians": table,
                               "preload_ready": getattr(preload, "ready", None),
                               "same_text": len(texts) == 1, "logs": str(work)}, indent=1))
    print(f"wrote {out}; logs in {work}")
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
