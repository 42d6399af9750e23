"""What a warm interpreter was made from, and whether an engine may start from it: the interpreter (its
binary and its venv), its startup flags, the weightcache version, the modules it imported (distribution,
version, and whether they changed on disk since), and the environment variables whose values shaped those
imports (the ones read while importing, found by watching os.environ, and the interpreter's own start-up
variables). Every other variable passes through to the engine, which reads it when it needs it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

from .. import __version__
from .command import PythonCommand
from .messages import ModuleStamp, Refused

# read at start-up by the interpreter or the dynamic loader, before any import could be watched
STARTUP_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "LD_PRELOAD")
# a shell's bookkeeping: read by some imports, meaningless to them
VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "_", "SHLVL", "COLUMNS", "LINES", "TERM", "SHELL"})
# applied to each engine (tempfile's cached directory is reset; -u and -B are per run)
PER_RUN_ENV = frozenset({"TMPDIR", "TEMP", "TMP", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
# read when a CUDA context is made: fixed only once torch has counted the devices
DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class _Recording(os._Environ):
    """os.environ that notes how each variable was first touched (it shares the real mapping's data):
    "read" (what was imported depends on its value then), "default" (setdefault, or read while unset and then
    set, as torch's inductor cache_dir() does: on its value or the default) or "write" (set before anyone read
    it: the value it had does not matter)."""

    def __init__(self, real: os._Environ, first: dict[str, tuple[str, str | None]]):
        super().__init__(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
        self.first, self.recording = first, True
        self.read_unset: set[str] = set()

    def _note(self, key, how: str, default: str | None = None) -> None:
        if self.recording and isinstance(key, str) and key not in self.first:
            self.first[key] = (how, default)

    def __getitem__(self, key):
        if self.recording and isinstance(key, str) and key not in self.first \
                and self.encodekey(key) not in self._data:
            self.read_unset.add(key)
        self._note(key, "read")
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if self.recording and key in self.read_unset:
            self.read_unset.discard(key)
            self.first[key] = ("default", value)
        self._note(key, "write")
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._note(key, "write")
        super().__delitem__(key)

    def setdefault(self, key, value):
        self._note(key, "default", value)
        was, self.recording = self.recording, False
        try:
            return super().setdefault(key, value)
        finally:
            self.recording = was


@contextlib.contextmanager
def watch_environ(first: dict[str, tuple[str, str | None]]):
    """Record into `first` how each variable is first touched through os.environ / os.getenv in the block."""
    real = os.environ
    rec = _Recording(real, first)
    setattr(os, "environ", rec)  # noqa: B010 (the real mapping stays underneath)
    try:
        yield
    finally:
        rec.recording = False  # modules that kept `from os import environ` keep a working mapping
        setattr(os, "environ", real)  # noqa: B010


def venv_of(interpreter: str) -> str:
    """The venv an interpreter path selects (where its pyvenv.cfg is), "" for none; symlinks kept."""
    d = os.path.dirname(os.path.abspath(interpreter))
    for cand in (d, os.path.dirname(d)):
        if os.path.isfile(os.path.join(cand, "pyvenv.cfg")):
            return os.path.realpath(cand)
    return ""


def _stamp(path: str | Path | None) -> tuple[int, int, int] | None:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclasses.dataclass
class _Module:
    stamp: ModuleStamp
    file: str  # the distribution's METADATA, else the module's own file
    at_import: tuple[int, int, int] | None


def _distributions() -> dict[str, list[str]]:
    try:
        return importlib.metadata.packages_distributions()
    except Exception:
        return {}


def _describe(name: str, seconds: float, dists: dict[str, list[str]]) -> _Module:
    top = name.split(".")[0]
    mod = sys.modules.get(top)
    for dist_name in dists.get(top, []):
        with contextlib.suppress(Exception):
            dist = importlib.metadata.distribution(dist_name)
            meta = getattr(dist, "_path", None)
            file = str(Path(meta) / "METADATA") if meta else ""
            return _Module(ModuleStamp(name=name, distribution=dist_name, version=dist.version, seconds=seconds),
                           file, _stamp(file))
    file = getattr(mod, "__file__", "") or ""
    return _Module(ModuleStamp(name=name, version=str(getattr(mod, "__version__", "")), seconds=seconds), file,
                   _stamp(file))


class Identity:
    """Made once, after the imports, in the warm interpreter; `check` is asked for every request."""

    def __init__(self, env_at_start: dict[str, str], first: dict[str, tuple[str, str | None]],
                 ignore: set[str] = frozenset()):
        self.executable = sys.executable
        self.binary = os.path.realpath(sys.executable)
        self.binary_stamp = _stamp(self.binary)
        self.prefix = os.path.realpath(sys.prefix) if sys.prefix != sys.base_prefix else ""
        self.python = sys.version.split()[0]
        self.env = dict(env_at_start)
        self.ignore = set(ignore)
        self.update_env(first)
        self.modules: list[_Module] = []
        self.import_seconds = 0.0
        self._dists: dict[str, list[str]] | None = None

    def update_env(self, first: dict[str, tuple[str, str | None]]) -> None:
        """The variables that must match, from what the imports so far read (`first`, see watch_environ)."""
        read = {n for n, (how, _) in first.items() if how != "write"}
        self.defaults = {n: d for n, (how, d) in first.items() if how == "default"}
        self.names = {n for n in read | set(STARTUP_ENV) if n not in VOLATILE_ENV | PER_RUN_ENV | self.ignore}

    def add_module(self, name: str, seconds: float) -> None:
        if self._dists is None:
            self._dists = _distributions()
        self.modules.append(_describe(name, seconds, self._dists))
        self.import_seconds += seconds

    def env_names(self, other: dict[str, str] = None) -> list[str]:
        """The variables that must match: those the imports read, the interpreter's start-up ones (every
        PYTHON* one), and the device list once torch counted the devices."""
        names = set(self.names)
        names |= {n for n in set(self.env) | set(other or ()) if n.startswith("PYTHON")} - PER_RUN_ENV
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch.cuda, "_cached_device_count", None) is not None:
            names |= set(DEVICE_ENV)
        return sorted(names - self.ignore)

    def env_digest(self) -> str:
        h = hashlib.sha256()
        for n in self.env_names():
            h.update(f"{n}={self.env.get(n, self.defaults.get(n))!r}\0".encode())
        return h.hexdigest()[:16]

    def stamps(self) -> list[ModuleStamp]:
        return [m.stamp for m in self.modules]

    # -- checks

    def check(self, *, protocol_ok: bool, weightcache: str, interpreter: str, env: dict[str, str],
              flags: list[str] | None = None, server_flags: list[str] | None = None) -> Refused | None:
        """None if an engine of this interpreter, flags and environment may start here, else why not."""
        if weightcache != __version__:
            return Refused(code="version", message=f"it runs weightcache {__version__}, the command "
                                                   f"weightcache {weightcache}")
        why = self.check_interpreter(interpreter)
        if why:
            return Refused(code="interpreter", message=why)
        if flags is not None and server_flags is not None and sorted(flags) != sorted(server_flags):
            return Refused(code="flags", message=f"the command's python flags {' '.join(flags) or '(none)'} are "
                                                 f"not the warm interpreter's ({' '.join(server_flags) or 'none'})")
        why = self.check_modules()
        if why:
            return Refused(code="modules", message=why)
        differ = [n for n in self.env_names(env)
                  if env.get(n, self.defaults.get(n)) != self.env.get(n, self.defaults.get(n))]
        if differ:
            return Refused(code="environment", message=(
                f"the environment differs from the warm interpreter's in {', '.join(differ[:8])}"
                + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
                + " (read while it imported; start it with the engine's environment, or pass --ignore-env NAME)"))
        return None

    def check_interpreter(self, interpreter: str) -> str:
        binary = os.path.realpath(interpreter)
        if binary != self.binary:
            return f"the command runs {interpreter} ({binary}), the warm interpreter {self.executable} ({self.binary})"
        if venv_of(interpreter) != self.prefix:
            return (f"the command's interpreter {interpreter} belongs to {venv_of(interpreter) or 'no venv'}, "
                    f"the warm one to {self.prefix or 'no venv'}")
        if _stamp(self.binary) != self.binary_stamp:
            return f"{self.binary} changed on disk since the warm interpreter started (Python {self.python})"
        return ""

    def check_modules(self) -> str:
        for m in self.modules:
            if _stamp(m.file) == m.at_import:
                continue
            now = ""
            if m.stamp.distribution:
                with contextlib.suppress(Exception):
                    now = importlib.metadata.version(m.stamp.distribution)
            what = m.stamp.distribution or m.stamp.name
            return (f"{what} {m.stamp.version} was imported by the warm interpreter; "
                    + (f"{what} {now} is installed now" if now else f"{m.file} changed or is gone since"))
        return ""


def initial_environ() -> dict[str, str]:
    """This process's environment as it was when it started (/proc/self/environ): imports may change
    os.environ (vLLM sets variables when imported), a warm interpreter started from here must not inherit that."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k:
            out[os.fsdecode(k)] = os.fsdecode(v)
    return out


def import_modules(names: list[str], first: dict[str, tuple[str, str | None]], on_module) -> None:
    """Import each module while watching os.environ; `on_module(name, seconds, error)` after each."""
    for name in names:
        t0 = time.perf_counter()
        error = None
        with watch_environ(first):
            try:
                importlib.import_module(name)
            except Exception as e:  # a module of another platform: the engine imports what it needs itself
                error = e
        on_module(name, time.perf_counter() - t0, error)


def startup_modules() -> frozenset[str]:
    """The modules this interpreter imports before any sys.path[0] exists (no file can shadow those)."""
    code = "import sys; print(' '.join(sys.modules))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
        return frozenset(out.stdout.split())
    except (OSError, subprocess.SubprocessError):
        return frozenset(sys.builtin_module_names)


def shadowed(cmd: PythonCommand, cwd: str, startup: frozenset[str] = frozenset()) -> str:
    """Why the engine's sys.path[0] would import another copy of a module the warm interpreter holds."""
    first = engine_path0(cmd, cwd)
    if not first or sys.flags.safe_path:
        return ""
    try:
        entries = set(os.listdir(first))
    except OSError:
        return ""
    suffixes = tuple(importlib.machinery.all_suffixes())
    found = {e.split(".")[0] for e in entries if e.endswith(suffixes)}
    found |= {e for e in entries if os.path.isfile(os.path.join(first, e, "__init__.py"))}
    for name in sorted(found & {n.split(".")[0] for n in sys.modules} - startup):
        origin = getattr(sys.modules.get(name), "__file__", None) or ""
        if not os.path.realpath(origin).startswith(os.path.realpath(first) + os.sep):
            return (f"{os.path.join(first, name)} would shadow the warm interpreter's {name} "
                    f"({os.path.dirname(origin) or 'built in'})")
    return ""


def engine_path0(cmd: PythonCommand, cwd: str) -> str:
    if cmd.kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(cwd, cmd.target)))
    return cwd
