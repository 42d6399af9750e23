"""vLLM engine start-up: loading from disk vs attaching from `weightcache preload --engine vllm`.

For each random-weight Llama checkpoint (tiny, and one of about --big-gb GB), a preload holds the weights;
then fresh engine processes (vLLM's `LLM`, in-process engine core), alternating, start with the default load
format and with `--load-format weightcache`, generate a few greedy tokens, and report:

  first token  from the engine process's start (imports included) to its first generated token
  startup      the `LLM(...)` constructor: config, model load, KV cache, compilation, warm-up
  load         vLLM's model load alone (the model runner's load_model)
  KV blocks    the KV cache's size vLLM chose (same --gpu-memory-utilization for both)

plus the daemon's own load time and its peak device memory while loading. The page cache is warm for the disk
loads (every run reads the same files). All runs must generate the same tokens. On CPU engines run with
--enforce-eager; on a GPU with vLLM's defaults (torch.compile + CUDA graphs) unless --eager. Prints a
markdown table (medians) and writes bench/results/vllm-startup-<device>.json.

    python bench/vllm_startup.py --runs 5 --big-gb 3 --workdir /tmp/wcvb                 # CPU
    python bench/vllm_startup.py --runs 3 --big-gb 16 --no-tiny --workdir /dev/shm/wcvb   # H200
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    import torch
    from vllm import LLM, SamplingParams

    timing = {}
    if torch.cuda.is_available():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner
    else:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner as Runner
    orig = Runner.load_model

    def timed(self, *a, **kw):
        t = time.perf_counter()
        try:
            return orig(self, *a, **kw)
        finally:
            timing["load"] = time.perf_counter() - t

    Runner.load_model = timed
    kw = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
              enforce_eager=spec["eager"], seed=0, max_num_seqs=4,
              gpu_memory_utilization=spec["gpu_memory_utilization"])
    if spec.get("attach"):
        kw.update(load_format="weightcache", model_loader_extra_config={"socket_dir": spec["socket_dir"]})
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    out = llm.generate(["Hello, world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    first = time.time() - float(os.environ["WC_SPAWNED_AT"])  # generating 8 tokens of a tiny prompt: ~first token
    cache = llm.llm_engine.vllm_config.cache_config
    return {"startup": startup, "load": timing.get("load"), "first_token": first,
            "kv_blocks": cache.num_gpu_blocks, "tokens": list(out[0].outputs[0].token_ids)}


LOAD_LINE = re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) s")


def _run_engine(spec: dict, env: dict) -> dict:
    env = {**env, "WC_SPAWNED_AT": repr(time.time())}
    r = subprocess.run([sys.executable, __file__, "--engine-run", json.dumps(spec)], capture_output=True,
                       text=True, env=env, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            if res["load"] is None:  # the engine core ran in its own process: take vLLM's own log line
                m = LOAD_LINE.search(r.stderr + r.stdout)
                res["load"] = float(m.group(1)) if m else None
            return res
    raise RuntimeError(f"engine run failed:\n{r.stderr[-3000:]}")


def _preload(model: str, socket_dir: str, env: dict, log: Path, max_model_len: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", model, "--dtype", "bfloat16",
           "--max-model-len", str(max_model_len), "--weight-cache-socket-dir", socket_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    for line in proc.stdout:
        if "READY" in line:
            return proc
    raise RuntimeError(f"preload failed, see {log}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big-gb", type=float, default=3.0, help="size of the larger checkpoint (0: skip it)")
    ap.add_argument("--no-tiny", action="store_true", help="only the larger checkpoint")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager on a GPU too (always on CPU)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="the same for both engines; leave room for the daemon's weights on the GPU")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--engine-run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_run:
        print("RESULT " + json.dumps(engine_run(json.loads(args.engine_run))), flush=True)
        return 0

    import torch

    from weightcache.testing.checkpoints import (
        estimate_llama_bytes,
        llama_config_for_bytes,
        make_llama_checkpoint,
    )

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wcvb"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "XDG_CACHE_HOME": str(work / "cache")}
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else "cpu"
    base = {"eager": args.eager or not cuda, "max_model_len": args.max_model_len if cuda else 128,
            "gpu_memory_utilization": args.gpu_memory_utilization if cuda else 0.3}
    models = [] if args.no_tiny else [("tiny", TINY)]
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
        pre = _preload(str(path), sock, env, work / f"preload-{name}.log", base["max_model_len"])
        preload_s = time.perf_counter() - t
        try:
            from weightcache.client import query_status

            st = query_status(next(Path(sock).glob("main-r0-*.sock")))
            res = {"disk": [], "attach": []}
            for _ in range(args.runs):  # interleaved, so both see the same machine state
                res["disk"].append(_run_engine({**base, "model": str(path)}, env))
                res["attach"].append(_run_engine({**base, "model": str(path), "attach": True, "socket_dir": sock},
                                                 env))
        finally:
            pre.send_signal(signal.SIGTERM)
            pre.wait(60)
            shutil.rmtree(sock, ignore_errors=True)
        tokens = {json.dumps(r["tokens"]) for rs in res.values() for r in rs}
        if len(tokens) != 1:
            raise RuntimeError(f"{name}: runs generated different tokens: {tokens}")
        row = {"model": name, "bytes": nbytes, "runs": args.runs, "preload_s": preload_s,
               "daemon_load_s": st.load_seconds, "daemon_bytes": st.nbytes, "daemon_blocks": st.nblocks,
               "daemon_peak_device_bytes": st.peak_device_bytes, **base}
        for method, rs in res.items():
            for k in ("startup", "load", "first_token"):
                vals = [r[k] for r in rs if r[k] is not None]
                row[f"{method}_{k}"] = statistics.median(vals) if vals else float("nan")
            row[f"{method}_all"] = [round(r["first_token"], 3) for r in rs]
            row[f"{method}_kv_blocks"] = sorted({r["kv_blocks"] for r in rs})
        rows.append(row)
        print(json.dumps(row), flush=True)
    import vllm

    out = ROOT / "bench" / "results" / f"vllm-startup-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "cpu": os.cpu_count(), "vllm": vllm.__version__,
                               "command": " ".join(sys.argv), "rows": rows}, indent=2))
    print("\n| model | weights | first token, disk | first token, attach | `LLM()`, disk | `LLM()`, attach | "
          "model load, disk | model load, attach | KV blocks disk / attach | daemon load | daemon peak |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['bytes'] / 2**30:.2f} GiB | {r['disk_first_token']:.2f} s | "
              f"{r['attach_first_token']:.2f} s | {r['disk_startup']:.2f} s | {r['attach_startup']:.2f} s | "
              f"{r['disk_load']:.3f} s | {r['attach_load']:.3f} s | {r['disk_kv_blocks']} / {r['attach_kv_blocks']} | "
              f"{r['daemon_load_s']:.2f} s | {r['daemon_peak_device_bytes'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
