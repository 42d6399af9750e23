"""What engines started warm went on to import, imported ahead for the next one.

An engine forked from the warm interpreter writes the names of its modules to the socket directory once it has
run a while (and at exit): `<dir>/warm-learned/<pid>.modules`. The warm interpreter imports those it lacks, at
its start and between engines, and keeps what it learned in `learned.modules` for its successors. On an H100
vLLM's engine core imported 788 further modules (1.9 s) after the warm ones: compilation passes, attention
backends, kernels, the model loader.

Only modules found on the interpreter's import path are recorded (not `__main__`, generated code, or files
of a compile cache); a name that fails to import is not tried again by this interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("weightcache.warm.learned")

DIR_NAME = "warm-learned"
KEPT = "learned.modules"
RECORD_AFTER_S = (20.0, 60.0, 180.0)  # an engine's start takes seconds to minutes; its imports are done by then
SKIP_PREFIXES = ("__main__", "__mp_main__", "transformers_modules", "torch._inductor.runtime.compile_tasks")


def directory(socket_dir: str | Path) -> Path:
    return Path(socket_dir) / DIR_NAME


def _roots() -> tuple[str, ...]:
    """Where importable modules live: the import path without the program's own directory (sys.path[0])."""
    return tuple(os.path.realpath(p) + os.sep for p in sys.path[1:] if p and os.path.isdir(p))


def _importable_name(name: str) -> bool:
    return not name.startswith(SKIP_PREFIXES) and all(part.isidentifier() for part in name.split("."))


def _recordable(name: str, module, roots: tuple[str, ...]) -> bool:
    if not _importable_name(name):
        return False
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if origin in ("built-in", "frozen"):
        return True
    return isinstance(origin, str) and os.path.realpath(origin).startswith(roots)


def module_names() -> list[str]:
    roots = _roots()
    return sorted(n for n, m in list(sys.modules.items()) if m is not None and _recordable(n, m, roots))


def _write(path: Path, names: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text("\n".join(names) + "\n")
        os.replace(tmp, path)


def record_later(where: str | Path, delays: tuple[float, ...] = RECORD_AFTER_S) -> None:
    """In an engine: write its modules after each delay and at exit (a daemon thread; never raises)."""
    where = Path(where)
    if not where.is_dir():
        return
    path = where / f"{os.getpid()}.modules"
    t0 = time.monotonic()

    def record():
        _write(path, module_names())

    def later():
        for d in delays:
            time.sleep(max(0.0, t0 + d - time.monotonic()))
            record()

    atexit.register(record)
    threading.Thread(target=later, name="weightcache-warm-learn", daemon=True).start()


def _read(path: Path) -> list[str]:
    try:
        return [n for n in path.read_text().split() if n]
    except OSError:
        return []


class Learner:
    """In the warm interpreter: which recorded modules it still lacks; `learn()` imports them while watching the
    environment (`first`, as the warm imports were) and tells `identity` what they read."""

    def __init__(self, where: str | Path, first: dict | None = None, identity=None, cuda_initialized=None):
        self.dir = Path(where)
        with contextlib.suppress(OSError):
            self.dir.mkdir(mode=0o700, exist_ok=True)
        self.first = {} if first is None else first
        self.identity = identity
        self.cuda_initialized = cuda_initialized or (lambda: False)
        self.failed: set[str] = set()
        self.learned: set[str] = set(_read(self.dir / KEPT))
        self.seconds = 0.0
        self._seen: tuple = ()

    def learn(self) -> bool:
        """Import what is pending; False (and everything learned forgotten) if that made a CUDA context or
        started a thread: a fork would then give engines a broken CUDA or locks held by a thread they lack."""
        from .identity import import_modules

        names = self.pending()
        ok: list[str] = []
        bad: list[str] = []
        threads = set(threading.enumerate())
        t0 = time.perf_counter()
        import_modules(names, self.first, lambda name, _s, error: (bad if error else ok).append(name))
        if self.identity is not None:
            self.identity.update_env(self.first)
            self.stamp_packages(ok)
        self.seconds += time.perf_counter() - t0
        if names:
            log.info("imported %d module(s) that engines imported after the warm ones in %.2f s (%d failed)",
                     len(ok), time.perf_counter() - t0, len(bad))
        started = [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
        why = "made a CUDA context" if self.cuda_initialized() else (
            f"started thread(s) {', '.join(started)}, which a fork would not carry" if started else "")
        if why:
            log.error("a module that an engine imported %s here: forgetting what engines imported; no engine can "
                      "start from this interpreter", why)
            self.forget()
            return False
        self.done(ok, bad)
        if ok:
            gc.collect()
            gc.freeze()  # as after the warm imports: engines' GC passes leave these pages shared
        return True

    def stamp_packages(self, imported=()) -> None:
        """Tell `identity` the packages what it learned (and `imported` now) came from: one reinstalled since
        refuses engines, as for the warm interpreter's own imports."""
        have = {m.stamp.name for m in self.identity.modules}
        for top in sorted({n.split(".")[0] for n in self.learned.union(imported)} - have):
            if top in sys.modules:
                self.identity.add_module(top, 0.0)

    def _records(self) -> list[Path]:
        try:
            return sorted(p for p in self.dir.iterdir() if p.suffix == ".modules" and p.name != KEPT)
        except OSError:
            return []

    def _stamp(self) -> tuple:
        stamp = []
        for p in self._records():
            with contextlib.suppress(OSError):
                stamp.append((p.name, p.stat().st_mtime_ns))
        return tuple(stamp)

    def changed(self) -> bool:
        """Whether an engine wrote a record since the last `pending()`."""
        return self._stamp() != self._seen

    def pending(self) -> list[str]:
        """Recorded (or kept) names not imported here yet; consumes the engines' records."""
        self._seen = self._stamp()
        names = set(self.learned).union(*(_read(self.dir / name) for name, _ in self._seen))
        return sorted(n for n in names if n not in sys.modules and n not in self.failed and _importable_name(n))

    def done(self, imported: list[str], failed: list[str]) -> None:
        """Keep what imported for the next warm interpreter; drop the records it came from."""
        self.failed.update(failed)
        self.learned.update(imported)
        self.learned.difference_update(failed)
        with contextlib.suppress(OSError):
            self.dir.mkdir(mode=0o700, exist_ok=True)
            _write(self.dir / KEPT, sorted(self.learned))
        for p in self._records():
            with contextlib.suppress(OSError):
                if (p.name, p.stat().st_mtime_ns) in self._seen:
                    p.unlink()
        self._seen = ()

    def forget(self) -> None:
        """Drop everything learned (what it imported made a CUDA context or started a thread)."""
        self.learned.clear()
        for p in [*self._records(), self.dir / KEPT]:
            with contextlib.suppress(OSError):
                p.unlink()
