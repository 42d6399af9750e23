"""`weightcache warm-engine`: import, check, bind, serve (server.py); in a forked child, become the engine
(engine.py). `--status` and `--stop` talk to the running one."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path

from ..errors import WeightCacheError
from ..sockets import ensure_private_dir, warm_socket_path
from .engine import become
from .identity import Identity, import_modules
from .launcher import write_launcher
from .learned import Learner
from .learned import directory as learned_directory
from .server import KILL_GRACE_S, WarmServer, cuda_initialized

log = logging.getLogger("weightcache.warm.main")

# vLLM first, as `vllm serve` imports it: its import sets variables (vllm/env_override.py) before torch reads them
DEFAULT_IMPORTS = ("vllm", "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main", "vllm.v1.engine.core",
                   "vllm.v1.executor.multiproc_executor", "torch", "transformers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="weightcache warm-engine",
        description="Keep an interpreter with torch, vLLM and transformers imported (no CUDA context); "
                    "`weightcache run -- CMD` starts engines from it.")
    p.add_argument("--socket-dir", default=None, help="default: the per-user socket directory")
    p.add_argument("--import", dest="imports", action="append", default=None, metavar="MODULE",
                   help=f"a module to import (repeatable; default: {', '.join(DEFAULT_IMPORTS)})")
    p.add_argument("--model", dest="models", action="append", default=[], metavar="DIR",
                   help="a model directory: import its architecture's vLLM and transformers modules too (repeatable)")
    p.add_argument("--ignore-env", action="append", default=[], metavar="NAME",
                   help="a variable whose value may differ between this interpreter and the engines")
    p.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, metavar="S",
                   help="when a client dies, SIGKILL its engine this long after SIGTERM")
    p.add_argument("--no-learn", action="store_true",
                   help="engines do not record the modules they import, and this interpreter imports none of them")
    p.add_argument("--no-spawn", action="store_true",
                   help="engines' multiprocessing spawn children start a fresh interpreter")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--status", action="store_true", help="print the running one's status (JSON) and exit")
    p.add_argument("--stop", action="store_true", help="retire the running one (it exits once its engines have)")
    args = p.parse_args(argv)
    if args.status or args.stop:
        return _control(args)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [warm-engine] %(name)s: %(message)s"))
    wc_log = logging.getLogger("weightcache")
    wc_log.addHandler(handler)
    wc_log.setLevel(args.log_level)
    wc_log.propagate = False
    from ..sockets import default_socket_dir_path

    socket_dir = Path(args.socket_dir) if args.socket_dir else default_socket_dir_path()
    try:
        ensure_private_dir(socket_dir)
    except WeightCacheError as e:
        print(f"weightcache warm-engine: error: {e}", file=sys.stderr)
        return 2
    path = warm_socket_path(socket_dir)
    server, code = prepare(path, args)
    if server is None:
        return code
    forked = server.serve()
    if forked is None:
        log.info("retired: exiting")
        return 0
    wc_log.removeHandler(handler)
    wc_log.setLevel(logging.NOTSET)
    wc_log.propagate = True
    return become(forked)


def _control(args) -> int:
    import json

    import msgspec

    from ..sockets import default_socket_dir_path
    from . import client

    path = warm_socket_path(Path(args.socket_dir) if args.socket_dir else default_socket_dir_path())
    try:
        if args.stop:
            running = client.retire(path)
            print(f"retired the warm engine interpreter at {path}"
                  + (f"; it exits once its {running} engine(s) exit" if running else ""))
        else:
            print(json.dumps(msgspec.to_builtins(client.query(path)), indent=2))
    except WeightCacheError as e:
        print(f"weightcache warm-engine: {e}", file=sys.stderr)
        return 1
    return 0


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


def prepare(path: Path, args) -> tuple[WarmServer | None, int]:
    """Import, check, bind; (None, exit code) when there is nothing to serve."""
    if not _pidfds_work():
        print("weightcache warm-engine: error: this kernel has no pidfds (Linux 5.3 or newer is needed)",
              file=sys.stderr)
        return None, 1
    env_at_start = dict(os.environ)
    _drop_own_path0()
    imports = args.imports if args.imports is not None else list(DEFAULT_IMPORTS)
    if not _installed("vllm"):
        imports = [m for m in imports if m.split(".")[0] != "vllm"]
    first: dict[str, tuple[str, str | None]] = {}
    done: list[tuple[str, float]] = []

    def on_module(name, seconds, error):
        if error is not None:
            log.warning("import %s failed (%s: %s); engines import it themselves", name, type(error).__name__, error)
        else:
            done.append((name, seconds))
            log.info("imported %s in %.2f s", name, seconds)

    import_modules(imports, first, on_module)
    if args.models:
        from .models import model_modules

        import_modules(list(dict.fromkeys(m for d in args.models for m in model_modules(d))), first, on_module)
    if cuda_initialized():
        print("weightcache warm-engine: error: importing " + ", ".join(imports) + " created a CUDA context; an "
              "engine forked from here could not use CUDA. Leave out the module that does it (--import)",
              file=sys.stderr)
        return None, 1
    learner = None
    if not args.no_learn:
        learner = Learner(learned_directory(path.parent), first, cuda_initialized=cuda_initialized)
        if not learner.learn():
            print("weightcache warm-engine: error: a module that engines imported before made a CUDA context or "
                  "started a thread here; what engines imported is forgotten: start the warm interpreter again",
                  file=sys.stderr)
            return None, 1
    identity = Identity(env_at_start, first, set(args.ignore_env))
    for name, seconds in done:
        identity.add_module(name, seconds)
    mods = ", ".join(f"{m.stamp.distribution or m.stamp.name} {m.stamp.version}".strip() for m in identity.modules
                     if "." not in m.stamp.name)
    if learner is not None:
        learner.identity = identity
        learner.stamp_packages()
        identity.import_seconds += learner.seconds
    _prepare_title()
    gc.collect()
    gc.freeze()  # what the imports made is shared with every engine: no GC pass of theirs copies its pages
    launcher = "" if args.no_spawn else write_launcher(path)
    server = WarmServer(path, identity, kill_grace=args.kill_grace, launcher=launcher, learner=learner)
    try:
        if not server.bind():
            log.info("a warm engine interpreter already serves %s", path)
            return None, 0
    except (OSError, WeightCacheError) as e:
        print(f"weightcache warm-engine: error: {e}", file=sys.stderr)
        return None, 1
    if learner is not None and learner.learned:
        mods += f" and {len(learner.learned)} module(s) engines imported before"
    print(f"weightcache warm-engine READY pid {os.getpid()}: {mods or 'nothing'} imported in "
          f"{identity.import_seconds:.1f} s; {len(identity.env_names())} environment variable(s) must match; "
          f"socket {path}", file=sys.stderr, flush=True)
    return server, 0


def _prepare_title() -> None:
    """setproctitle claims the argv and environ memory on first use; the engines' environment replaces the C
    environ, after which it could not: claim it now, so that each engine can show its own command line."""
    try:
        import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):
        setproctitle.setproctitle(setproctitle.getproctitle())


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _drop_own_path0() -> None:
    """Our own sys.path[0] (the cwd under -m, a bin directory for a console script) is not the engine's."""
    if sys.path and sys.path[0] not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        sys.path.pop(0)
