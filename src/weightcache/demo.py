"""`weightcache demo`: what a weight cache daemon buys an engine, measured, on this machine.

Builds a random-weight Llama checkpoint locally (no download) and starts a daemon that holds it. Then:

* on CPU: several transformers engines run at once, first each loading the checkpoint from disk, then each
  attaching it from the daemon. It reports their memory (PSS from /proc/<pid>/smaps_rollup: a page shared by
  n processes counts 1/n in each), how long the attach itself took next to building the model skeleton (the
  same work on both paths), that the attach does not grow with the model (a second, 10x smaller model), and
  that the weights outlive every engine.
* on a GPU: engines restart one after another, loading from disk vs attaching, and a table shows how long
  the weights took and the speedup.

Every engine generates a few greedy tokens; they must all agree.
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

PROMPT = "The weight cache keeps"
SPEEDUP_WORTH_A_HEADLINE = 1.5


def _default_device() -> str:
    import torch

    if torch.cuda.is_available():
        from .arena import cuda

        if cuda.available():
            return "cuda"
    return "cpu"


# ---- one engine, in its own process ----------------------------------------------------------------------

def run_engine(model_dir: str, device: str, socket_dir: str, new_tokens: int) -> None:
    """Import, then for each command on stdin ("disk" or "cache") drop the model it has, take the weights
    that way, generate, and report; "exit" ends it. Restart times count from the process's spawn."""
    t_spawn = float(os.environ.get("WEIGHTCACHE_DEMO_T0", time.time()))
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import transformers as wct

    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.device("meta"):  # the model's code imported once, before either path is timed
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    if device == "cuda":
        torch.empty(1, device="cuda")
    t_imports = time.time()
    _say({"state": "imported"})
    model = None
    while (source := sys.stdin.readline().strip()) in ("disk", "cache"):
        model = None
        gc.collect()
        _release_free_memory()
        t_go = time.time()
        t0 = time.perf_counter()
        if source == "disk":
            if device == "cuda":
                try:
                    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
                except (ImportError, ValueError):  # without accelerate
                    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
            else:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
            parts = {}
        else:
            model = wct.from_pretrained(model_dir, device=device, dtype=torch.bfloat16, socket_dir=socket_dir,
                                        fallback=False)
            parts = dict(model._weightcache_timings)
        if device == "cuda":
            torch.cuda.synchronize()
        weights_s = time.perf_counter() - t0
        ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        first_token = time.time()
        _say({"source": source, "weights_s": weights_s, "parts": parts, "pid": os.getpid(),
              "restart_s": (t_imports - t_spawn) + (first_token - t_go), "tokens": out[0, ids.shape[1]:].tolist()})


def _release_free_memory() -> None:
    """Hand memory freed by the last model back to the kernel, so that memory figures start over."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Engine:
    """A demo engine process, driven over its stdin/stdout."""

    def __init__(self, model_dir: Path, device: str, socket_dir: Path, new_tokens: int):
        env = {**os.environ, "WEIGHTCACHE_DEMO_T0": repr(time.time()), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache.demo", "--engine", "--model", str(model_dir), "--device", device,
             "--socket-dir", str(socket_dir), "--new-tokens", str(new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"a demo engine failed:\n{self.proc.stderr.read()[-4000:]}")
        return json.loads(line)

    def wait_imported(self) -> None:
        self._read()

    def load(self, source: str) -> dict:
        self.proc.stdin.write(source + "\n")
        self.proc.stdin.flush()
        return self._read()

    def exit(self) -> None:
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        self.proc.stdout.close()


def memory_of(pid: int) -> dict[str, int]:
    """Rss, Pss and their anonymous / file / shared-memory parts, in bytes (smaps_rollup)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


# ---- the demo -----------------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms"


def _each_engine(engines: list[Engine], source: str) -> tuple[list[dict], list[dict], dict]:
    """Every engine takes its weights from `source`, one engine at a time (uncontended timings); then, all
    of them alive and holding their models, their memory and the daemon's (this process) are read."""
    results = [e.load(source) for e in engines]
    return results, [memory_of(r["pid"]) for r in results], memory_of(os.getpid())


def _attach_ms(sock: Path, tries: int = 15) -> float:
    from .client import attach

    times = []
    for _ in range(tries):
        att = attach(sock)
        times.append(att.timings["total"])
        att.close()
    return statistics.median(times)


def _serve(model_dir: Path, dev, socket_dir: Path):
    """A daemon holding the checkpoint as `weightcache preload --model DIR` holds it for one rank:
    transformers' own from_pretrained in bfloat16, captured. Returns (daemon, socket, load seconds)."""
    from .daemon import Daemon
    from .integrations.transformers.producer import TransformersSource
    from .preload.layout import Placement
    from .sockets import device_tag, socket_path

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo prints its own lines
    except ImportError:
        pass
    source = TransformersSource(Placement("main", 0, 0, 0, False, 0, 1, 0, 0, str(dev), 1, 1, 1),
                                path=str(model_dir), dtype="bfloat16")
    key = source.key("dp1-pp1-tp1")
    sock = socket_path(socket_dir, key, device_tag(dev))
    daemon = Daemon(sock, key, device=dev)
    try:
        daemon.start()
        t = time.perf_counter()
        source.produce(daemon)
    except BaseException:
        daemon.close()
        raise
    return daemon, sock, time.perf_counter() - t


def _make_checkpoint(path: Path, size_mb: int, dtype) -> None:
    """Written next to `path` and renamed once complete: an interrupted write never passes for a checkpoint."""
    from .testing.checkpoints import llama_config_for_bytes, make_llama_checkpoint

    if (path / "config.json").exists():
        return
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        make_llama_checkpoint(partial, **llama_config_for_bytes(size_mb << 20, dtype), dtype=dtype,
                              max_shard_bytes=1 << 30, direct=True)
        os.replace(partial, path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def checkpoint_bytes(size_mb: int, dtype) -> int:
    """What _make_checkpoint writes for `size_mb`, tokenizer and configs included (an estimate from above)."""
    from .testing.checkpoints import estimate_llama_bytes, llama_config_for_bytes

    return estimate_llama_bytes(dtype=dtype, **llama_config_for_bytes(size_mb << 20, dtype)) + (4 << 20)


def _check_room(work: Path, device: str, size_mb: int, engines: int, file_dtype) -> None:
    """Refuse, before writing anything, a demo this machine has no room for: the checkpoints on disk, and on
    CPU the daemon's bfloat16 copy plus one per engine that loads from disk (all alive at once) in memory."""
    import torch

    from .arena.host import available_host_memory

    sizes = [size_mb, max(1, size_mb // 10)] if device == "cpu" else [size_mb]
    need = sum(checkpoint_bytes(mb, file_dtype) for mb in sizes)
    existing = sum(f.stat().st_size for mb in sizes for f in (work / f"llama-random-{mb}mb").glob("*")
                   if f.is_file())  # written by an earlier run in --workdir: used again
    free = shutil.disk_usage(work).free
    if need - existing > free:
        raise DemoError(f"--size-mb {size_mb} needs {_gib(need)} of disk in {work}, {_gib(free)} is free: "
                        "pass a smaller --size-mb or another --workdir")
    if device == "cpu":
        bf16 = checkpoint_bytes(size_mb, torch.bfloat16)
        mem, avail = bf16 * (engines + 1), available_host_memory()
        if mem > avail:
            raise DemoError(f"--size-mb {size_mb} with --engines {engines} needs about {_gib(mem)} of memory "
                            f"(the daemon's copy and one per engine), {_gib(avail)} is available: pass a smaller "
                            "--size-mb or fewer --engines")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


class DemoError(Exception):
    """A demo this machine cannot run, or bad flags: one line, exit code 2."""


class _Stopped(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def _stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up runs once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stopped(signum)


def _cpu_demo(a, console, model_dir, daemon, sock, work, socket_dir, size_mb) -> bool:
    import torch
    from rich.table import Table

    n = a.engines
    engines = [Engine(model_dir, "cpu", socket_dir, a.new_tokens) for _ in range(n)]
    try:
        for e in engines:
            e.wait_imported()
        base = [memory_of(e.proc.pid)["Pss"] for e in engines]  # each engine's runtime, before any model
        runs = {}
        for source in ("cache", "disk"):  # attaching first: it leaves next to nothing behind
            results, mems, daemon_mem = _each_engine(engines, source)
            added = [m["Pss"] - b for m, b in zip(mems, base, strict=True)]
            runs[source] = (results, added, daemon_mem)
            how = "attached it" if source == "cache" else "loaded it from disk"
            console.print(f"{n} engines {how}: weights in {', '.join(_ms(r['weights_s']) for r in results)}; "
                          f"memory added {', '.join(_mib(x) for x in added)}")
    finally:
        for e in engines:
            e.exit()

    # the attach does not grow with the model: a model 10x smaller, attached the same way
    small_mb = max(1, size_mb // 10)
    small_dir = work / f"llama-random-{small_mb}mb"
    _make_checkpoint(small_dir, small_mb, torch.float32)
    small, small_sock, _ = _serve(small_dir, torch.device("cpu"), socket_dir)
    with small:
        small_bytes, small_tensors = small.manifest.nbytes, len(small.manifest.tensors)
        attach_small = _attach_ms(small_sock)
    attach_big = _attach_ms(sock)

    st = daemon.status()
    disk, disk_added, _ = runs["disk"]
    cache, cache_added, daemon_mem = runs["cache"]
    daemon_share = daemon_mem.get("Pss_Shmem", 0)  # its part of the weights' pages, if it touched any
    daemon_runtime = daemon_mem["Pss"] - daemon_share
    disk_total, cache_total = sum(disk_added), sum(cache_added) + daemon_share
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731
    t = Table(title=f"{n} engines at once, CPU, {_mib(st.nbytes)} of bf16 weights")
    for col in ("", "from disk", "attached"):
        t.add_column(col, justify="right")
    t.add_row("copies of the weights", str(n), "1")
    t.add_row("memory of the models (PSS)", _mib(disk_total), _mib(cache_total))
    t.add_row("  per engine (median)", _mib(statistics.median(disk_added)), _mib(statistics.median(cache_added)))
    t.add_row("daemon process itself", "-", _mib(daemon_runtime))
    t.add_row("weights ready (median)", _ms(med(disk, lambda r: r["weights_s"])),
              _ms(med(cache, lambda r: r["weights_s"])))
    t.add_row("  model skeleton", "in from_pretrained", _ms(med(cache, lambda r: r["parts"]["skeleton"])))
    t.add_row("  attach", "-", _ms(med(cache, lambda r: r["parts"]["attach"])))
    console.print(t)
    console.print(
        f"[bold]memory:[/] {n} engines holding the model used {_mib(disk_total)} loading it from disk and "
        f"{_mib(cache_total)} attaching one shared copy (PSS counts a page shared by k processes 1/k in each; "
        f"measured above each engine's own runtime). The daemon's process costs {_mib(daemon_runtime)} of its "
        "own (Python, torch) whatever the model's size. Here the checkpoint is float32 and engines run bfloat16, "
        "so each engine that loads it makes its own copy, as with quantized, sharded or post-processed weights; "
        "a checkpoint an engine uses byte for byte is mapped from the page cache and shared on CPU by "
        "transformers too.")
    console.print(
        f"[bold]attach:[/] {_ms(attach_big)} for {_mib(st.nbytes)} ({st.ntensors} tensors), {_ms(attach_small)} "
        f"for {_mib(small_bytes)} ({small_tensors} tensors): it maps the daemon's memory and reads nothing, so it "
        "does not grow with the model. Building the model's skeleton (its modules, on the meta device) is the "
        "same work on both paths and is most of what remains.")
    console.print(
        f"[bold]lifetime:[/] {n} engines attached and exited; the daemon still holds {_mib(st.nbytes)} "
        f"({st.state}, {st.attaches_served} attaches served): the next engine attaches the same weights "
        "without reading the checkpoint.")
    return len({tuple(r["tokens"]) for r in disk + cache}) == 1


def _gpu_demo(a, console, model_dir, socket_dir, size_mb) -> bool:
    from rich.table import Table

    rows = []
    for i in range(a.restarts):
        for source in ("disk", "cache"):
            e = Engine(model_dir, "cuda", socket_dir, a.new_tokens)
            try:
                e.wait_imported()
                r = e.load(source)
            finally:
                e.exit()
            r["restart"] = i + 1
            rows.append(r)
            console.print(f"restart {i + 1} from {source:<5}: weights {_ms(r['weights_s'])}, "
                          f"first token after {r['restart_s']:.2f} s")
    table = Table(title=f"engine restarts on cuda, ~{size_mb} MB of weights")
    for col in ("restart", "disk: weights", "cache: weights", "speedup", "disk: restart", "cache: restart"):
        table.add_column(col, justify="right")
    for i in range(a.restarts):
        d = next(r for r in rows if r["restart"] == i + 1 and r["source"] == "disk")
        c = next(r for r in rows if r["restart"] == i + 1 and r["source"] == "cache")
        table.add_row(str(i + 1), _ms(d["weights_s"]), _ms(c["weights_s"]), f"{d['weights_s'] / c['weights_s']:.1f}x",
                      f"{d['restart_s']:.2f} s", f"{c['restart_s']:.2f} s")
    console.print(table)
    med = {s: statistics.median(r["weights_s"] for r in rows if r["source"] == s) for s in ("disk", "cache")}
    ratio = med["disk"] / med["cache"]
    verdict = (f"[bold green]{ratio:.1f}x faster[/]" if ratio >= SPEEDUP_WORTH_A_HEADLINE
               else "no real difference at this size (try a larger --size-mb)")
    console.print(f"median weights: disk {_ms(med['disk'])}, cache {_ms(med['cache'])} -> {verdict}")
    return len({tuple(r["tokens"]) for r in rows}) == 1


def _count(low: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v

    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="weightcache demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--size-mb", type=_count(1, "a size in MB"), default=None,
                   help="checkpoint size (default 300 on CPU, 4000 on GPU)")
    p.add_argument("--engines", type=_count(1, "a number of engines"), default=3,
                   help="engines running at once (CPU)")
    p.add_argument("--restarts", type=_count(1, "a number of restarts"), default=3,
                   help="engine restarts per source (GPU)")
    p.add_argument("--new-tokens", type=_count(1, "a number of tokens"), default=8)
    p.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.engine:
        run_engine(a.model, a.device, a.socket_dir, a.new_tokens)
        return 0

    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _demo(a)
    except DemoError as e:
        print(f"weightcache demo: error: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        print(f"weightcache demo: stopped by {e}; its files are removed", file=sys.stderr)
        return 128 + getattr(signal, str(e)).value
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _demo(a) -> int:
    import torch
    from rich.console import Console

    console = Console()
    device = _default_device() if a.device == "auto" else a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda but no CUDA device is visible")
    size_mb = a.size_mb or (4000 if device == "cuda" else 300)
    file_dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CPU: engines convert what they load
    if a.workdir is not None:
        work = Path(a.workdir)
        if work.exists() and not work.is_dir():
            raise DemoError(f"--workdir {a.workdir} is not a directory")
        try:
            work.mkdir(parents=True, exist_ok=True)
            if not os.access(work, os.W_OK | os.X_OK):
                raise PermissionError(f"{work} is not writable")
        except OSError as e:
            raise DemoError(f"--workdir {a.workdir}: {e.strerror or e}") from None
    else:
        _check_room(Path(tempfile.gettempdir()), device, size_mb, a.engines, file_dtype)
        work = Path(tempfile.mkdtemp(prefix="weightcache-demo-"))
    socket_dir = None
    try:
        if a.workdir is not None:
            _check_room(work, device, size_mb, a.engines, file_dtype)
        socket_dir = Path(tempfile.mkdtemp(prefix="wcd", dir="/tmp"))
        model_dir = work / f"llama-random-{size_mb}mb"
        console.print(f"[bold]weightcache demo[/] on [cyan]{device}[/]: random Llama checkpoint of ~{size_mb} MB "
                      f"({str(file_dtype).removeprefix('torch.')}), served as bfloat16")
        t = time.perf_counter()
        _make_checkpoint(model_dir, size_mb, file_dtype)
        console.print(f"checkpoint written to {model_dir} in {time.perf_counter() - t:.1f} s")

        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        daemon, sock, load_s = _serve(model_dir, dev, socket_dir)
        with daemon:
            st = daemon.status()
            console.print(f"daemon holds {st.ntensors} tensors, {_mib(st.nbytes)} in {st.nblocks} block(s) "
                          f"(loaded in {load_s:.2f} s) at {sock}")
            if device == "cuda":
                same = _gpu_demo(a, console, model_dir, socket_dir, size_mb)
            else:
                same = _cpu_demo(a, console, model_dir, daemon, sock, work, socket_dir, size_mb)
        console.print("every engine generated the same tokens" if same
                      else "[red]engines generated different tokens[/]")
        return 0 if same else 1
    finally:
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
