"""Restart to first completion of vLLM's OpenAI server, cold vs started from the warm engine interpreter.

Side by side, alternating, each run a fresh engine on a free port (`python -m vllm.entrypoints.openai.api_server`,
a random-weight Llama from weightcache.testing, --enforce-eager unless --compile):

  cold            the command itself
  warm            `weightcache run -- <command>`: the API server forks from a warm interpreter; vLLM's engine core
                  and workers, spawned, come from it too where their environment matches
  warm-children   the same with a warm interpreter told to --ignore-env the variables vLLM's CPU platform sets for
                  its children (--children-ignore; CPU only: LD_PRELOAD of torch's libgomp, an inductor setting),
                  so that the engine core and its worker fork warm too, as they do on a GPU without it
  *-nolearn       a warm kind whose interpreter does not import what earlier engines imported (--no-learn)

Phases from the arrival of the engine's output lines (each process tags its lines): start -> the API server's
first line (interpreter + imports) -> the engine core's first line (config, engine core start and its imports)
-> its worker's first line -> /health 200 (model load, KV cache, server start) -> the first completion. The warm
interpreters' own imports are paid before the runs and reported apart. Prints a markdown table of medians and
writes bench/results/warm-start-<device>.json.

    python bench/warm_start.py --runs 3 --workdir /tmp/wcws                                   # CPU
    python bench/warm_start.py --runs 3 --kinds cold,warm --compile --workdir /dev/shm/wcws   # GPU: vLLM's defaults
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from child_env import free_port  # noqa: E402

TINY = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2, vocab_size=512)
ENV = dict(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1")
CPU_CHILD_ENV = ("LD_PRELOAD", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS")
MARKS = (("api", re.compile(r"^\(APIServer pid=")), ("core", re.compile(r"^\(EngineCore\w* pid=")),
         ("worker", re.compile(r"^\((Vllm)?Worker[-\w]* pid=")))
PHASES = (("imports", "start -> API server's first line"), ("core", "-> engine core's first line"),
          ("worker", "-> worker's first line"), ("health", "-> /health 200"), ("completion", "-> first completion"),
          ("total", "start -> first completion"))


def start_warm(sockdir: Path, env: dict, ignore: tuple[str, ...],
               learn: bool = True) -> tuple[subprocess.Popen, float, list[str]]:
    sockdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "weightcache.cli", "warm-engine", "--socket-dir", str(sockdir)]
    if not learn:
        argv.append("--no-learn")
    for name in ignore:
        argv += ["--ignore-env", name]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if "READY" in line:
            break
    if proc.poll() is not None:
        raise SystemExit("warm-engine did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
    return proc, time.monotonic() - t0, lines


def warm_status(sockdir: Path) -> dict:
    from weightcache.sockets import warm_socket_path
    from weightcache.warm.client import query

    st = query(warm_socket_path(sockdir))
    return {"started": st.started, "refused": st.refused, "import_seconds": st.import_seconds}


def one_run(kind: str, engine_argv: list[str], env: dict, sockdir: Path | None, model: str, timeout: float) -> dict:
    port = free_port()
    argv = engine_argv + ["--port", str(port)]
    if sockdir is not None:
        argv = [sys.executable, "-m", "weightcache.cli", "run", "--require-warm", "--socket-dir", str(sockdir),
                "--", *argv]
    before = warm_status(sockdir) if sockdir else None
    marks: dict[str, float] = {}
    log: list[str] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def pump():
        for line in proc.stdout:
            now = time.monotonic() - t0
            log.append(line)
            for name, tag in MARKS:
                if name not in marks and tag.match(line):
                    marks[name] = now

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind}: the engine exited with {proc.returncode}:\n" + "".join(log[-30:]))
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"{kind}: no /health in {timeout:.0f} s")
        marks["health"] = time.monotonic() - t0
        body = json.dumps({"model": model, "prompt": "Hello, world", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        marks["completion"] = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        reader.join(5)
    after = warm_status(sockdir) if sockdir else None
    forks = after["started"] - before["started"] if sockdir else 0
    refused = after["refused"] - before["refused"] if sockdir else 0
    phases, prev = {}, 0.0
    for name in ("api", "core", "worker", "health", "completion"):
        if name in marks:
            phases[{"api": "imports"}.get(name, name)] = marks[name] - prev
            prev = marks[name]
    phases["total"] = marks["completion"]
    return {"kind": kind, "phases": phases, "marks": marks, "text": text, "warm_forks": forks,
            "warm_refused": refused, "spawn_lines": [ln.strip() for ln in log if "warm spawn" in ln][:4]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/wcws")
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a tiny random Llama)")
    p.add_argument("--compile", action="store_true", help="vLLM's default compilation instead of --enforce-eager")
    p.add_argument("--kinds", default="cold,warm,warm-children")
    p.add_argument("--children-ignore", default=",".join(CPU_CHILD_ENV),
                   help="variables the warm-children interpreter may see differ (comma-separated)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    model = args.model
    if model is None:
        from weightcache.testing.checkpoints import make_llama_checkpoint

        model = str(work / "model")
        if not (Path(model) / "config.json").exists():
            make_llama_checkpoint(model, **TINY)
    engine = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
              "--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0"]
    if not args.compile:
        engine.append("--enforce-eager")
    kinds = args.kinds.split(",")
    servers, warm_info = {}, {}
    try:
        for kind in kinds:
            if kind == "cold":
                continue
            children = kind.startswith("warm-children")
            ignore = tuple(n for n in args.children_ignore.split(",") if n) if children else ()
            sockdir = work / f"s-{kind}"
            shutil.rmtree(sockdir, ignore_errors=True)
            proc, seconds, lines = start_warm(sockdir, env, ignore, learn=not kind.endswith("-nolearn"))
            servers[kind] = (proc, sockdir)
            warm_info[kind] = {"ready_seconds": seconds, "ignore_env": list(ignore),
                               "ready_line": next((x.strip() for x in lines if "READY" in x), "")}
            print(f"{kind}: warm interpreter ready in {seconds:.1f} s", flush=True)
        runs = []
        for i in range(args.runs):
            for kind in kinds:
                sockdir = servers[kind][1] if kind in servers else None
                r = one_run(kind, engine, env, sockdir, model, args.timeout)
                r["round"] = i
                runs.append(r)
                print(f"round {i} {kind:<14} " + " ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
                      + f"  warm forks {r['warm_forks']}, refused {r['warm_refused']}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    texts = {r["text"] for r in runs}
    summary = {}
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        summary[kind] = {ph: statistics.median(r["phases"][ph] for r in mine if ph in r["phases"])
                         for ph, _ in PHASES if any(ph in r["phases"] for r in mine)}
        summary[kind]["warm_forks"] = statistics.median(r["warm_forks"] for r in mine)
    print()
    print("| phase (median s) | " + " | ".join(kinds) + " |")
    print("| --- | " + " | ".join("---" for _ in kinds) + " |")
    for ph, label in PHASES:
        cells = [f"{summary[k][ph]:.1f}" if ph in summary[k] else "-" for k in kinds]
        print(f"| {ph}: {label} | " + " | ".join(cells) + " |")
    print("| processes forked warm per run | " + " | ".join(f"{summary[k]['warm_forks']:.0f}" for k in kinds) + " |")
    for kind, info in warm_info.items():
        print(f"\n{kind}: {info['ready_line']}")
    print(f"\nsame completion text in every run: {len(texts) == 1}")
    device = "gpu" if os.path.exists("/dev/nvidia0") else "cpu"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"warm-start-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device, "runs": runs, "summary": summary, "warm_interpreters": warm_info,
        "same_text": len(texts) == 1, "engine_argv": engine, "load_average": os.getloadavg(),
        "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
