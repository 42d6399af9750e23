"""`weightcache demo`: restart a toy engine several times, loading from disk vs attaching from a daemon.

Builds a random-weight Llama checkpoint locally (no download), starts a daemon that holds it, then starts
fresh engine processes (transformers) that take their weights either with `from_pretrained` from disk or from
the daemon, generate a few greedy tokens, and report how long each restart took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The weight cache keeps"


def _default_device() -> str:
    import torch

    if torch.cuda.is_available():
        from .arena import cuda

        if cuda.available():
            return "cuda"
    return "cpu"


def run_engine(source: str, model_dir: str, device: str, socket_dir: str, new_tokens: int) -> dict:
    """One engine restart, inside a fresh process. Times are from the process's spawn."""
    t_spawn = float(os.environ.get("WEIGHTCACHE_DEMO_T0", time.time()))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_imports = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if device == "cuda":
        torch.empty(1, device="cuda")
    t0 = time.perf_counter()
    if source == "disk":
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=device)
        except (ImportError, ValueError):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    else:
        from . import transformers as wct

        model = wct.from_pretrained(model_dir, device=device, dtype=torch.bfloat16, socket_dir=socket_dir,
                                    fallback=False)
    if device == "cuda":
        torch.cuda.synchronize()
    weights_s = time.perf_counter() - t0
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    first_token = time.time()
    return {
        "source": source, "weights_s": weights_s, "restart_s": first_token - t_spawn,
        "imports_s": t_imports - t_spawn, "tokens": out[0, ids.shape[1]:].tolist(),
    }


def _spawn_engine(source, model_dir, device, socket_dir, new_tokens) -> dict:
    env = {**os.environ, "WEIGHTCACHE_DEMO_T0": repr(time.time()), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.demo", "--engine", source, "--model", model_dir, "--device", device,
         "--socket-dir", socket_dir, "--new-tokens", str(new_tokens)],
        capture_output=True, text=True, env=env,
    )
    if proc.returncode:
        raise RuntimeError(f"{source} engine failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="weightcache demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--size-mb", type=int, default=None, help="checkpoint size (default 300 on CPU, 4000 on GPU)")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.add_argument("--engine", choices=["disk", "cache"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.engine:
        print(json.dumps(run_engine(a.engine, a.model, a.device, a.socket_dir, a.new_tokens)))
        return 0

    import torch
    from rich.console import Console
    from rich.table import Table

    from .checkpoints import llama_config_for_bytes, make_llama_checkpoint
    from .daemon import Daemon
    from .layout import Placement
    from .naming import device_tag, socket_path
    from .sources.transformers import TransformersSource

    console = Console()
    device = _default_device() if a.device == "auto" else a.device
    size_mb = a.size_mb or (4000 if device == "cuda" else 300)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="weightcache-demo-"))
    socket_dir = Path(tempfile.mkdtemp(prefix="wcd", dir="/tmp"))
    model_dir = work / f"llama-random-{size_mb}mb"
    try:
        console.print(f"[bold]weightcache demo[/] on [cyan]{device}[/]: random Llama checkpoint of ~{size_mb} MB")
        t = time.perf_counter()
        if not (model_dir / "config.json").exists():
            make_llama_checkpoint(model_dir, **llama_config_for_bytes(size_mb << 20, torch.bfloat16),
                                  dtype=torch.bfloat16, max_shard_bytes=1 << 30)
        console.print(f"checkpoint written to {model_dir} in {time.perf_counter() - t:.1f} s")

        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        # what `weightcache preload --model DIR` runs for one rank: transformers' own from_pretrained, captured
        source = TransformersSource(Placement("main", 0, 0, 0, False, 0, 1, 0, 0, str(dev), 1, 1, 1),
                                    path=str(model_dir), dtype="bfloat16")
        key = source.key("dp1-pp1-tp1")
        sock = socket_path(socket_dir, key, device_tag(dev))
        daemon = Daemon(sock, key, device=dev)
        daemon.start()
        t = time.perf_counter()
        source.load_into(daemon)
        st = daemon.status()
        console.print(f"daemon holds {st.ntensors} tensors, {st.nbytes / 2**20:.0f} MiB in {st.nblocks} block(s) "
                      f"(loaded in {time.perf_counter() - t:.2f} s) at {sock}")

        rows = []
        for i in range(a.restarts):
            for source in ("disk", "cache"):
                r = _spawn_engine(source, str(model_dir), device, str(socket_dir), a.new_tokens)
                r["restart"] = i + 1
                rows.append(r)
                console.print(f"restart {i + 1} from {source:<5}: weights {r['weights_s'] * 1e3:8.1f} ms, "
                              f"first token after {r['restart_s']:.2f} s")
        daemon.close()

        table = Table(title=f"engine restarts on {device}, ~{size_mb} MB of weights")
        for col in ("restart", "disk: weights", "cache: weights", "speedup", "disk: restart", "cache: restart"):
            table.add_column(col, justify="right")
        for i in range(a.restarts):
            d = next(r for r in rows if r["restart"] == i + 1 and r["source"] == "disk")
            c = next(r for r in rows if r["restart"] == i + 1 and r["source"] == "cache")
            table.add_row(str(i + 1), f"{d['weights_s'] * 1e3:.1f} ms", f"{c['weights_s'] * 1e3:.1f} ms",
                          f"{d['weights_s'] / c['weights_s']:.0f}x", f"{d['restart_s']:.2f} s", f"{c['restart_s']:.2f} s")
        console.print(table)
        med = {s: statistics.median(r["weights_s"] for r in rows if r["source"] == s) for s in ("disk", "cache")}
        tokens = {tuple(r["tokens"]) for r in rows}
        same = len(tokens) == 1
        console.print(f"median weight load: disk {med['disk'] * 1e3:.1f} ms, cache {med['cache'] * 1e3:.1f} ms "
                      f"-> [bold green]{med['disk'] / med['cache']:.0f}x[/] faster; "
                      + ("every engine generated the same tokens" if same else "[red]engines generated different tokens[/]"))
        return 0 if same else 1
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
