"""A daemon holds a rank at 1x: `weightcache preload --engine vllm` of a checkpoint that fills most of a GPU,
then an engine attaches it.

Writes a random-weight bf16 Llama checkpoint of about --gb GB (to --workdir, e.g. /dev/shm), starts the preload
and samples, from outside, the device memory in use above what was in use before it started (NVML, every
20 ms) until READY; compares that peak with the weights' size (the goal: at most 1.1x + 2 GiB). Then one
engine (vLLM's `LLM`) attaches the weights and generates; its KV cache size is reported. Writes
bench/results/vllm-hold-<device>.json.

    python bench/vllm_hold.py --gb 85 --workdir /dev/shm/wchold
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
           PYTHONUNBUFFERED="1")


class DeviceMemory:
    """Device memory in use (NVML; torch's view of the device as a fallback), sampled in a thread."""

    def __init__(self, index: int = 0, every_s: float = 0.02):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
        except Exception:
            import torch

            self.used = lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info(index))
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self.base = self.used()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used() - self.base)
            time.sleep(self.every_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.used() - self.base)


def engine_run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0, max_num_seqs=4,
              gpu_memory_utilization=spec["util"], load_format="weightcache",
              model_loader_extra_config={"socket_dir": spec["socket_dir"]})
    startup = time.perf_counter() - t0
    out = llm.generate(["Hello, world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    return {"startup": startup, "tokens": list(out[0].outputs[0].token_ids), "kv_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=85.0, help="checkpoint size in GB (10^9 bytes)")
    ap.add_argument("--workdir", default="/dev/shm/wchold")
    ap.add_argument("--util", type=float, default=0.95, help="the attaching engine's --gpu-memory-utilization")
    ap.add_argument("--engine-run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_run:
        print("RESULT " + json.dumps(engine_run(json.loads(args.engine_run))), flush=True)
        return 0

    import torch

    from weightcache.client import query_status
    from weightcache.testing.checkpoints import (
        estimate_llama_bytes,
        llama_config_for_bytes,
        make_llama_checkpoint,
    )

    work = Path(args.workdir)
    model = work / f"llama-{args.gb:g}gb"
    shape = llama_config_for_bytes(int(args.gb * 1e9), torch.bfloat16)
    weights = estimate_llama_bytes(dtype=torch.bfloat16, **shape)
    t = time.perf_counter()
    if not (model / "config.json").exists():
        make_llama_checkpoint(model, dtype=torch.bfloat16, direct=True, **shape)
    write_s = time.perf_counter() - t
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"checkpoint: {weights / 1e9:.1f} GB ({100 * weights / total:.0f}% of the GPU), written in {write_s:.0f} s",
          flush=True)
    env = {**os.environ, **ENV, "XDG_CACHE_HOME": str(work / "cache")}
    sock = tempfile.mkdtemp(prefix="wchold", dir="/tmp")
    os.chmod(sock, 0o700)
    log = open(work / "preload.log", "w")
    cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--engine", "vllm", str(model), "--dtype", "bfloat16",
           "--max-model-len", "1024", "--weight-cache-socket-dir", sock]
    with DeviceMemory() as mem:
        t = time.perf_counter()
        pre = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        for line in pre.stdout:
            if "READY" in line:
                break
        else:
            log.flush()
            raise SystemExit(f"preload failed:\n{(work / 'preload.log').read_text()[-4000:]}")
        preload_s = time.perf_counter() - t
    try:
        st = query_status(next(Path(sock).glob("main-r0-*.sock")))
        held = mem.used() - mem.base
        r = subprocess.run([sys.executable, __file__, "--engine-run",
                            json.dumps({"model": str(model), "socket_dir": sock, "util": args.util})],
                           capture_output=True, text=True, env=env, timeout=1200)
        eng = next((json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if eng is None:
            raise SystemExit(f"engine failed:\n{r.stderr[-3000:]}")
    finally:
        pre.send_signal(signal.SIGTERM)
        pre.wait(120)
    limit = 1.1 * weights + 2 * 2**30
    row = {"weights_bytes": weights, "gpu_total_bytes": total, "preload_s": preload_s,
           "daemon_load_s": st.load_seconds, "arena_bytes": st.nbytes, "arena_blocks": st.nblocks,
           "peak_device_bytes_sampled": mem.peak, "peak_device_bytes_daemon": st.peak_device_bytes,
           "held_after_ready_bytes": held, "peak_over_weights": mem.peak / weights, "limit_bytes": limit,
           "within_limit": mem.peak <= limit, "engine": eng, "command": " ".join(sys.argv)}
    device = torch.cuda.get_device_name(0).split()[-1].lower()
    out = ROOT / "bench" / "results" / f"vllm-hold-{device}.json"
    out.write_text(json.dumps(row, indent=2))
    print(f"| weights | arena (blocks) | daemon peak (sampled / own) | limit 1.1x + 2 GiB | preload | engine "
          f"LLM() | KV blocks |\n| --- | --- | --- | --- | --- | --- | --- |\n"
          f"| {weights / 2**30:.1f} GiB | {st.nbytes / 2**30:.1f} GiB ({st.nblocks}) | {mem.peak / 2**30:.1f} / "
          f"{st.peak_device_bytes / 2**30:.1f} GiB ({mem.peak / weights:.3f}x) | {limit / 2**30:.1f} GiB | "
          f"{preload_s:.0f} s | {eng['startup']:.1f} s | {eng['kv_blocks']} |")
    return 0 if row["within_limit"] else 1


if __name__ == "__main__":
    sys.exit(main())
