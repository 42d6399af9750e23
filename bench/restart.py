"""Restart benchmark: a fresh engine process to its first generated token, three ways.

For each random-weight checkpoint (Llama-shaped dense models, or a Qwen3-MoE-shaped one; written once into
--ckpt-dir and reused), several fresh engine processes each load the model and generate one token greedily:

  transformers  AutoModelForCausalLM.from_pretrained from a warm page cache (straight onto the device)
  weightcache   weightcache.transformers.from_pretrained attaching the weights a daemon holds (zero-copy map);
                the daemon built them with transformers' own from_pretrained (weightcache.integrations.transformers.producer)
  cuda_ipc      legacy CUDA IPC: a producer builds the same model the same way and shares every tensor through
                torch.multiprocessing.reductions (what vLLM's and SGLang's weight caches do); the engine
                rebuilds every tensor and binds them with the same code as weightcache

Each engine reports its phases (interpreter + imports, CUDA context, weight load = the call that returns a
ready model, tokenizer + first token) and the device memory it added; the whole restart is measured from the
parent's spawn to the first token. All engines must produce the same first token.

    python bench/restart.py --models 8b 32b --runs 3 --ckpt-dir /data/wc-bench   # H200 (8b ~16 GB, 32b ~66 GB)
    python bench/restart.py --models 30b-a3b --runs 3 --ckpt-dir /dev/shm/wcb   # MoE, Qwen3-30B-A3B-shaped, ~61 GB
    python bench/restart.py --models tiny --runs 2 --device cpu --ckpt-dir /tmp/wcb   # smoke test anywhere
    python bench/restart.py --plot-only bench/results/restart-cuda.json               # redraw the plot

Writes bench/results/restart-<device>.json (rows are merged into an existing file, so models can be run in
separate invocations), bench/results/restart-<device>.md (rows for docs/benchmarks.md) and docs/restart.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.time()  # engine processes: before any heavy import

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
ENGINES = ("transformers", "weightcache", "cuda_ipc")
PRESETS = {  # Llama-3-8B and a 32B (Qwen2.5-32B-like) shape in the Llama architecture
    "tiny": dict(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1024),
    "8b": dict(hidden_size=4096, num_layers=32, intermediate_size=14336, num_heads=32, num_kv_heads=8,
               vocab_size=128256),
    "32b": dict(hidden_size=5120, num_layers=64, intermediate_size=27648, num_heads=40, num_kv_heads=8,
                vocab_size=152064),
}
MOE_PRESETS = {  # Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 active): ~30.5B parameters, ~61 GB bf16
    "30b-a3b": dict(hidden_size=2048, num_layers=48, num_experts=128, experts_per_token=8, moe_intermediate_size=768,
                    num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936),
    "tiny-moe": dict(hidden_size=256, num_layers=2, num_experts=8, experts_per_token=2, moe_intermediate_size=128,
                     num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1024),
}
SHARD_BYTES = 2 << 30  # many shards: the digest is computed in parallel, loaders get parallelism
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_DISABLE_TELEMETRY": "1"}


# ---------------------------------------------------------------- checkpoints (written once)

def preset_shapes(name: str) -> dict:
    if name in MOE_PRESETS:
        return dict(MOE_PRESETS[name])
    if name in PRESETS:
        return dict(PRESETS[name])
    if name.endswith("gb"):
        from weightcache.testing.checkpoints import llama_config_for_bytes

        return llama_config_for_bytes(int(float(name[:-2]) * 1e9))
    raise SystemExit(f"unknown model {name!r}: one of {sorted(PRESETS) + sorted(MOE_PRESETS)} or a size such as 24gb")


def _moe_bytes(shapes: dict, dtype: torch.dtype) -> int:
    import math

    from weightcache.testing.checkpoints import moe_config, qwen3_moe_param_shapes

    esz = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) for s in qwen3_moe_param_shapes(moe_config("qwen3_moe", **shapes)).values()) * esz


def ensure_checkpoint(ckpt_dir: Path, name: str, dtype: torch.dtype) -> tuple[Path, dict]:
    from weightcache.testing.checkpoints import (
        estimate_llama_bytes,
        make_llama_checkpoint,
        make_moe_checkpoint,
    )

    shapes = preset_shapes(name)
    moe = name in MOE_PRESETS
    nbytes = _moe_bytes(shapes, dtype) if moe else estimate_llama_bytes(dtype=dtype, **shapes)
    path = ckpt_dir / f"{'qwen3moe' if moe else 'llama'}-{name}-{str(dtype).removeprefix('torch.')}"
    stamp = path / ".bench-complete"
    want = json.dumps({"shapes": shapes, "dtype": str(dtype)}, sort_keys=True)
    info = {"shapes": shapes, "bytes": nbytes}
    if stamp.exists() and stamp.read_text() == want:
        print(f"[{name}] reusing {path} ({nbytes / 1e9:.1f} GB)", flush=True)
        return path, info
    shutil.rmtree(path, ignore_errors=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ckpt_dir).free
    if free < nbytes * 1.03 + (1 << 30):
        raise SystemExit(f"[{name}] needs {nbytes / 1e9:.1f} GB in {ckpt_dir}, only {free / 1e9:.1f} GB free: "
                         "pass another --ckpt-dir (e.g. /dev/shm/...) or a smaller model")
    t0 = time.perf_counter()
    if moe:
        make_moe_checkpoint(path, "qwen3_moe", dtype=dtype, seed=0, max_shard_bytes=SHARD_BYTES,
                            direct=nbytes > (1 << 30), **shapes)
    else:
        make_llama_checkpoint(path, dtype=dtype, seed=0, max_shard_bytes=SHARD_BYTES, direct=nbytes > (1 << 30),
                              **shapes)
    info["write_seconds"] = time.perf_counter() - t0
    print(f"[{name}] wrote {path} ({nbytes / 1e9:.1f} GB) in {info['write_seconds']:.1f} s", flush=True)
    stamp.write_text(want)
    return path, info


def digest_and_warm(path: Path) -> float:
    """Hash every weight file once, in parallel (remembered by weightcache.key, so no engine hashes), which
    also brings the files into the page cache."""
    from weightcache.digests import checkpoint_digest, checkpoint_files, file_digest

    t0 = time.perf_counter()
    files = checkpoint_files(path)
    with concurrent.futures.ThreadPoolExecutor(min(16, len(files))) as pool:
        list(pool.map(file_digest, files))
    checkpoint_digest(path)
    return time.perf_counter() - t0


def _read_all(f: Path) -> None:
    with open(f, "rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass


def warm_page_cache(path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    with concurrent.futures.ThreadPoolExecutor(min(8, len(files))) as pool:
        list(pool.map(_read_all, files))


# ---------------------------------------------------------------- producers (their own processes)

def run_daemon(model: str, socket_dir: str, device: str, dtype: str) -> None:
    """What `weightcache preload --model MODEL` runs for one rank: transformers' from_pretrained, captured."""
    from weightcache.daemon import Daemon
    from weightcache.integrations.transformers.producer import TransformersSource
    from weightcache.preload.layout import Placement
    from weightcache.sockets import device_tag, socket_path

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    src = TransformersSource(Placement("main", 0, 0, 0, False, 0, 1, dev.index or 0, 0, device, 1, 1, 1),
                             path=model, dtype=dtype)
    key = src.key("dp1-pp1-tp1")
    d = Daemon(socket_path(socket_dir, key, device_tag(device)), key, device=device)
    d.start()
    t0 = time.perf_counter()
    src.produce(d)
    st = d.status()
    print("READY " + json.dumps({"load_seconds": time.perf_counter() - t0, "nbytes": st.nbytes,
                                 "peak_device_bytes": st.peak_device_bytes}), flush=True)
    d.serve_forever()


def run_ipc_producer(model: str, target: str, device: str, dtype: str) -> None:
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    from weightcache.dtypes import parse_dtype
    from weightcache.integrations.transformers.producer import build_model, capture

    dt = parse_dtype(dtype)
    t0 = time.perf_counter()
    m, seen = build_model(model, dtype=dt, device=torch.device(device))
    tensors, roles = capture(m, seen.before, seen.after, seen.conversions_used)
    torch.cuda.synchronize()
    Path(target).write_bytes(pickle.dumps([(n, roles[n], reduce_tensor(t)) for n, t in tensors.items()]))
    print("READY " + json.dumps({"load_seconds": time.perf_counter() - t0}), flush=True)
    while True:
        time.sleep(3600)


def spawn_producer(args: list[str], timeout: float = 1800) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **CHILD_ENV})
    line = p.stdout.readline().strip()
    if not line.startswith("READY"):
        p.kill()
        p.wait()
        raise RuntimeError(f"producer {args[:2]} failed to start: {line!r}")
    return p, json.loads(line[5:] or "{}")


# ---------------------------------------------------------------- the engine (a fresh process per run)

def engine(method: str, model: str, device: str, dtype: str, socket_dir: str, ipc_file: str, new_tokens: int) -> dict:
    import importlib

    import transformers  # noqa: F401  (part of every engine's start-up)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import weightcache.transformers as wct
    from weightcache.dtypes import parse_dtype

    # The model's modeling module: every engine imports it (transformers does inside from_pretrained); counted
    # with the imports so that the weight-load phase is the same work for all three.
    model_type = json.loads((Path(model) / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    dt = parse_dtype(dtype)
    cuda = device.startswith("cuda")
    phases = {}
    t_imported = time.time()
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # context up, as in any engine start
    t_ctx = time.time()
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    variant = method
    if method == "transformers":
        try:
            m = AutoModelForCausalLM.from_pretrained(model, dtype=dt, device_map={"": device})
            variant = "device_map"
        except ValueError as e:  # transformers wants accelerate for device_map: load on the CPU, then move
            if "accelerate" not in str(e):
                raise
            m = AutoModelForCausalLM.from_pretrained(model, dtype=dt).to(device)
            variant = "cpu_then_to"
    elif method == "weightcache":
        m = wct.from_pretrained(model, device=device, dtype=dt, socket_dir=socket_dir, fallback=False)
        assert m._weightcache_source == "attach"
        phases = m._weightcache_timings  # key / attach / meta build / bind
    elif method == "cuda_ipc":
        import pickle

        from weightcache.integrations.model_state import read_side_data
        from weightcache.integrations.transformers.compat import META_FORMAT, META_NAME
        from weightcache.integrations.transformers.engine import build

        payload = pickle.loads(Path(ipc_file).read_bytes())
        t = time.perf_counter()
        tensors = {n: fn(*a) for n, _, (fn, a) in payload}
        roles = {n: r for n, r, _ in payload}
        phases["rebuild"] = time.perf_counter() - t
        meta = read_side_data(tensors, META_NAME, META_FORMAT, "transformers", "no side data")
        m, seconds = build(model, tensors, roles, meta, device=torch.device(device), dtype=dt)
        phases.update(seconds)
    else:
        raise ValueError(method)
    if cuda:
        torch.cuda.synchronize()
    t_loaded = time.time()
    free1 = torch.cuda.mem_get_info()[0] if cuda else 0
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cuda:
        torch.cuda.synchronize()
    t_token = time.time()
    free2 = torch.cuda.mem_get_info()[0] if cuda else 0
    return {
        "t_process": T_PROCESS, "t_imported": t_imported, "t_ctx": t_ctx, "t_loaded": t_loaded, "t_token": t_token,
        "load_seconds": t_loaded - t_ctx, "added_by_load": free0 - free1, "added_total": free0 - free2,
        "tokens": out[0, ids.shape[1]:].tolist(), "ntensors": len(m.state_dict()), "phases": phases,
        "variant": variant,
    }


def run_engine(method: str, model: Path, a, socket_dir: str, ipc_file: str) -> dict:
    t_spawn = time.time()
    out = subprocess.run(
        [sys.executable, __file__, "--role", "engine", "--method", method, "--model", str(model), "--device",
         a.device, "--dtype", a.dtype, "--socket-dir", socket_dir, "--ipc-file", ipc_file,
         "--new-tokens", str(a.new_tokens)],
        capture_output=True, text=True, env={**os.environ, **CHILD_ENV},
    )
    if out.returncode:
        raise RuntimeError(f"engine {method} failed:\n{out.stderr[-4000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["restart_seconds"] = r["t_token"] - t_spawn
    r["startup_seconds"] = r["t_imported"] - t_spawn  # interpreter + imports
    r["ctx_seconds"] = r["t_ctx"] - r["t_imported"]
    r["first_token_seconds"] = r["t_token"] - r["t_loaded"]  # tokenizer + prefill + one decode step
    for k in ("t_process", "t_imported", "t_ctx", "t_loaded", "t_token"):
        r.pop(k)
    return r


# ---------------------------------------------------------------- orchestration

def _med(runs: list[dict], k: str):
    vals = [r[k] for r in runs if r.get(k) is not None]
    return statistics.median(vals) if vals else None


def summarize(model: str, method: str, runs: list[dict], info: dict, extra: dict) -> dict:
    row = {"model": model, "engine": method, "bytes": info["bytes"], "runs": len(runs), "tokens": runs[0]["tokens"],
           "tensors": runs[0]["ntensors"], "variant": runs[0]["variant"], **extra}
    for k in runs[0]["phases"]:
        row[f"phase_{k}_median"] = statistics.median(r["phases"][k] for r in runs)
    for k in ("restart_seconds", "load_seconds", "startup_seconds", "ctx_seconds", "first_token_seconds",
              "added_by_load", "added_total"):
        row[k + "_median"] = _med(runs, k)
        row[k + "_all"] = [r[k] for r in runs]
    return row


def bench_model(name: str, a, work: Path) -> tuple[dict, list[dict]]:
    from weightcache.dtypes import parse_dtype

    dt = parse_dtype(a.dtype)
    path, info = ensure_checkpoint(Path(a.ckpt_dir), name, dt)
    info["digest_seconds"] = digest_and_warm(path)
    try:
        import psutil

        info["page_cache_fits"] = psutil.virtual_memory().total > info["bytes"] * 1.1
    except ImportError:
        pass
    rows = []
    sockdir = tempfile.mkdtemp(prefix="wcr", dir="/tmp")
    os.chmod(sockdir, 0o700)
    ipc_file = str(work / f"{name}.ipc")
    engines = [e for e in a.engines if not (e == "cuda_ipc" and not a.device.startswith("cuda"))]
    try:
        for method in engines:
            prod, extra = None, {}
            try:
                if method == "weightcache":
                    prod, ready = spawn_producer(["--role", "daemon", "--model", str(path), "--socket-dir", sockdir,
                                                  "--device", a.device, "--dtype", a.dtype])
                    extra = {"daemon_load_seconds": ready["load_seconds"]}
                elif method == "cuda_ipc":
                    prod, ready = spawn_producer(["--role", "ipc", "--model", str(path), "--ipc-file", ipc_file,
                                                  "--device", a.device, "--dtype", a.dtype])
                    extra = {"producer_load_seconds": ready["load_seconds"]}
                else:
                    warm_page_cache(path)
                runs = []
                for i in range(a.runs):
                    r = run_engine(method, path, a, sockdir, ipc_file)
                    runs.append(r)
                    ph = ", ".join(f"{k} {_fmt_s(v)}" for k, v in r["phases"].items())
                    print(f"[{name}] {method:<12} run {i + 1}/{a.runs}: restart {r['restart_seconds']:7.2f} s, "
                          f"weight load {r['load_seconds']:7.3f} s, +{r['added_by_load'] / 2**30:6.2f} GiB"
                          + (f" ({ph})" if ph else ""), flush=True)
                rows.append(summarize(name, method, runs, info, extra))
            finally:
                if prod is not None:
                    prod.terminate()
                    try:
                        prod.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        prod.kill()
                        prod.wait()
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
        Path(ipc_file).unlink(missing_ok=True)
    firsts = {r["engine"]: r["tokens"] for r in rows}
    if len({json.dumps(t) for t in firsts.values()}) > 1:
        raise RuntimeError(f"[{name}] engines generated different tokens: {firsts}")
    if not a.keep_checkpoints:
        shutil.rmtree(path, ignore_errors=True)
    return info, rows


def table(rows: list[dict]) -> str:
    base = {r["model"]: r for r in rows if r["engine"] == "transformers"}
    lines = ["| model | size | engine | weight load (median) | whole restart to first token | vs transformers "
             "(load / restart) | GPU memory added by load | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = base.get(r["model"])
        ratio = (f"{b['load_seconds_median'] / r['load_seconds_median']:.0f}x / "
                 f"{b['restart_seconds_median'] / r['restart_seconds_median']:.1f}x") if b else ""
        lines.append(
            f"| {r['model']} | {r['bytes'] / 1e9:.1f} GB | {r['engine']} | {_fmt_s(r['load_seconds_median'])} | "
            f"{_fmt_s(r['restart_seconds_median'])} | {ratio} | {r['added_by_load_median'] / 2**30:.2f} GiB | "
            f"{r['runs']} |")
    return "\n".join(lines)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def plot(result_file: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result_file.read_text())
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]
    colors = {"startup": "#bbbbbb", "load": "#d62728", "first": "#1f77b4"}
    short = {"transformers": "HF", "weightcache": "wc", "cuda_ipc": "IPC"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / max(1, len(engines))
    ticks, ticklabels, loads = [], [], []
    for mi, model in enumerate(models):
        for ei, eng in enumerate(engines):
            r = next((r for r in rows if r["model"] == model and r["engine"] == eng), None)
            if r is None:
                continue
            x = mi + (ei - (len(engines) - 1) / 2) * width
            ticks.append(x)
            gb = next(q["bytes"] for q in rows if q["model"] == model) / 1e9
            ticklabels.append(f"{short[eng]}\n{model}" if ei else f"{short[eng]}\n{model} ({gb:.0f} GB)")
            pre = r["restart_seconds_median"] - r["load_seconds_median"] - r["first_token_seconds_median"]
            bottom = 0.0
            for v, k in [(pre, "startup"), (r["load_seconds_median"], "load"), (r["first_token_seconds_median"], "first")]:
                ax1.bar(x, v, width * 0.9, bottom=bottom, color=colors[k])
                bottom += v
            ax1.text(x, bottom, f"{bottom:.1f} s", ha="center", va="bottom", fontsize=7)
            ax2.bar(x, r["load_seconds_median"], width * 0.9, color=colors["load"])
            ax2.text(x, r["load_seconds_median"], _fmt_s(r["load_seconds_median"]), ha="center", va="bottom",
                     fontsize=7)
            loads.append(r["load_seconds_median"])
    for ax in (ax1, ax2):
        ax.set_xticks(ticks, ticklabels, fontsize=7)
    ax1.set_ylabel("seconds (median)")
    ax1.set_title("fresh engine process to first token")
    from matplotlib.patches import Patch

    ax1.legend([Patch(color=colors[k]) for k in colors],
               ["interpreter, imports, CUDA context", "weight load", "tokenizer + first token"], fontsize=8)
    ax2.set_yscale("log")
    if loads:
        ax2.set_ylim(min(loads) / 3, max(loads) * 3)
    ax2.set_ylabel("seconds (median, log)")
    ax2.set_title("weight-load phase")
    meta = data.get("meta", {})
    fig.suptitle(f"weightcache restart ({meta.get('gpu') or meta.get('device', '')}, {meta.get('dtype', '')}, "
                 f"torch {meta.get('torch', '')}, transformers {meta.get('transformers', '')}; "
                 "HF = transformers from_pretrained, wc = weightcache attach, IPC = legacy CUDA IPC)", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    print(f"wrote {png}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help="presets (tiny, 8b, 32b) or sizes like 24gb")
    p.add_argument("--runs", type=int, default=3, help="fresh engine processes per engine (median reported)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints are written once and reused")
    p.add_argument("--keep-checkpoints", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=str(ROOT / "docs" / "restart.png"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", default=None, metavar="JSON")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", help=argparse.SUPPRESS)
    p.add_argument("--ipc-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.role == "daemon":
        run_daemon(a.model, a.socket_dir, a.device, a.dtype)
        return 0
    if a.role == "ipc":
        run_ipc_producer(a.model, a.ipc_file, a.device, a.dtype)
        return 0
    if a.role == "engine":
        print(json.dumps(engine(a.method, a.model, a.device, a.dtype, a.socket_dir, a.ipc_file, a.new_tokens)))
        return 0
    if a.plot_only:
        plot(Path(a.plot_only), Path(a.plot))
        return 0
    if a.runs < 1 or a.new_tokens < 1:
        p.error("--runs and --new-tokens must be at least 1")
    if not a.ckpt_dir:
        p.error("--ckpt-dir is required (checkpoints are written there once and reused)")
    models = a.models or (["8b", "32b"] if a.device.startswith("cuda") else ["tiny"])
    for m in models:
        preset_shapes(m)
    os.environ.setdefault("XDG_CACHE_HOME", str(Path(a.ckpt_dir) / ".cache"))  # digests next to the checkpoints
    dev_kind = "cuda" if a.device.startswith("cuda") else "cpu"
    out = Path(a.out or ROOT / "bench" / "results" / f"restart-{dev_kind}.json")
    import transformers

    meta = {"host": socket.gethostname(), "device": a.device, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(torch.device(a.device)) if dev_kind == "cuda" else platform.processor(),
            "dtype": a.dtype, "runs": a.runs, "new_tokens": a.new_tokens, "date": time.strftime("%Y-%m-%d"),
            "command": "python bench/restart.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    result = {"meta": meta, "models": {}, "rows": []}
    if out.exists():
        old = json.loads(out.read_text())
        result["models"] = old.get("models", {})
        # rows of other models, and of engines this run does not measure, are kept (engines may run separately)
        result["rows"] = [r for r in old.get("rows", []) if r["model"] not in models or r["engine"] not in a.engines]
    with tempfile.TemporaryDirectory(prefix="wcr", dir="/tmp") as work:
        for m in models:
            info, rows = bench_model(m, a, Path(work))
            info.update(command=meta["command"], date=meta["date"])
            result["models"][m] = info
            result["rows"] += rows
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))  # after every model: partial runs keep their rows
    md = table(result["rows"])
    print("\n" + md)
    out.with_suffix(".md").write_text(f"Command: `{meta['command']}` ({meta['gpu']}, {meta['date']})\n\n{md}\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    if not a.no_plot:
        try:
            plot(out, Path(a.plot))
        except ImportError:
            print(f"matplotlib not installed: redraw later with --plot-only {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
