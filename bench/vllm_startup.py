"""vLLM engine start-up on CPU: loading from disk vs attaching from `weightcache preload --engine vllm`.

For each random-weight Llama checkpoint (tiny, and one of about --big-gb GB), a preload holds the weights;
then several fresh engine processes (vLLM's `LLM`, in-process engine core, --enforce-eager) start with the
default load format and with `--load-format weightcache`, generate a few greedy tokens, and report:

  startup  the `LLM(...)` constructor: config, model load, KV cache, warm-up (what a restart waits for)
  load     vLLM's model load alone (the model runner's load_model)

The page cache is warm for the disk loads (every run reads the same files). All runs must generate the same
tokens. Prints a markdown table (medians) and writes bench/results/vllm-startup-cpu.json.

    python bench/vllm_startup.py --runs 5 --big-gb 3 --workdir /tmp/wcvb
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2, vocab_size=512)
ENV = dict(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
           VLLM_ENABLE_V1_MULTIPROCESSING="0")


def engine_run(spec: dict) -> dict:
    """One engine start (runs in a fresh process)."""
    from vllm import LLM, SamplingParams
    from vllm.v1.worker import cpu_model_runner

    timing = {}
    orig = cpu_model_runner.CPUModelRunner.load_model

    def timed(self, *a, **kw):
        t = time.perf_counter()
        try:
            return orig(self, *a, **kw)
        finally:
            timing["load"] = time.perf_counter() - t

    cpu_model_runner.CPUModelRunner.load_model = timed
    kw = dict(model=spec["model"], dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
              max_num_seqs=4, gpu_memory_utilization=0.3)
    if spec.get("attach"):
        kw.update(load_format="weightcache", model_loader_extra_config={"socket_dir": spec["socket_dir"]})
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    out = llm.generate(["Hello, world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"startup": startup, "load": timing.get("load"), "tokens": list(out[0].outputs[0].token_ids)}


def _run_engine(spec: dict, env: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--engine-run", json.dumps(spec)], capture_output=True,
                       text=True, env=env, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"engine run failed:\n{r.stderr[-3000:]}")


def _preload(model: str, socket_dir: str, env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", model, "--dtype", "bfloat16",
           "--max-model-len", "128", "--weight-cache-socket-dir", socket_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    for line in proc.stdout:
        if "READY" in line:
            return proc
    raise RuntimeError(f"preload failed, see {log}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big-gb", type=float, default=3.0, help="size of the larger checkpoint (0: skip it)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--engine-run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_run:
        print("RESULT " + json.dumps(engine_run(json.loads(args.engine_run))), flush=True)
        return 0

    import torch

    from weightcache.checkpoints import estimate_llama_bytes, llama_config_for_bytes, make_llama_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wcvb"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "XDG_CACHE_HOME": str(work / "cache")}
    models = [("tiny", TINY)]
    if args.big_gb > 0:
        models.append((f"{args.big_gb:g}gb", llama_config_for_bytes(int(args.big_gb * 2**30), torch.bfloat16)))
    rows = []
    for name, shape in models:
        path = work / name
        if not (path / "config.json").exists():
            make_llama_checkpoint(path, dtype=torch.bfloat16, **shape)
        nbytes = estimate_llama_bytes(dtype=torch.bfloat16, **shape)
        sock = tempfile.mkdtemp(prefix="wcvb", dir="/tmp")
        os.chmod(sock, 0o700)
        t = time.perf_counter()
        pre = _preload(str(path), sock, env, work / f"preload-{name}.log")
        preload_s = time.perf_counter() - t
        try:
            res = {"disk": [], "attach": []}
            for _ in range(args.runs):  # interleaved, so both see the same machine state
                res["disk"].append(_run_engine({"model": str(path)}, env))
                res["attach"].append(_run_engine({"model": str(path), "attach": True, "socket_dir": sock}, env))
        finally:
            pre.send_signal(signal.SIGTERM)
            pre.wait(60)
            shutil.rmtree(sock, ignore_errors=True)
        tokens = {json.dumps(r["tokens"]) for rs in res.values() for r in rs}
        if len(tokens) != 1:
            raise RuntimeError(f"{name}: runs generated different tokens: {tokens}")
        row = {"model": name, "bytes": nbytes, "runs": args.runs, "preload_s": preload_s}
        for method, rs in res.items():
            row[f"{method}_startup"] = statistics.median(r["startup"] for r in rs)
            row[f"{method}_load"] = statistics.median(r["load"] for r in rs)
            row[f"{method}_all"] = [round(r["startup"], 3) for r in rs]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = ROOT / "bench" / "results" / "vllm-startup-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": os.cpu_count(), "rows": rows}, indent=2))
    print("\n| model | weights | engine start-up, disk | engine start-up, attach | model load, disk | "
          "model load, attach |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['bytes'] / 2**30:.2f} GiB | {r['disk_startup']:.2f} s | "
              f"{r['attach_startup']:.2f} s | {r['disk_load']:.3f} s | {r['attach_load']:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
