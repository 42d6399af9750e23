"""The forked child's side: become the caller's engine. Its own session, the caller's fds at their numbers,
umask, cwd, environment (the C one too: libraries read it later), ignored signals, argv and sys.path[0];
then `__main__` runs as `python -m`, `python -c` or `python SCRIPT` would run it, and the process ends the way
that interpreter would (atexit, threads joined, exit status, KeyboardInterrupt as SIGINT).

What import-time state a fresh interpreter would have differently is reset here: the logging handlers of the
warm server, stdout's buffering (a tty is line-buffered), tempfile's cached directory, numpy's global seed,
multiprocessing's authkey, the process title. Python's `random` reseeds itself after a fork.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import fcntl
import io
import logging
import os
import signal
import sys
import types

from .command import PythonCommand
from .messages import Run

_DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                     signal.SIGXFSZ: signal.SIG_IGN}
_RESET = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
          signal.SIGCHLD, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTSTP, signal.SIGCONT,
          signal.SIGWINCH)
EXIT_CANNOT_START = 126


@dataclasses.dataclass
class Forked:
    """What a forked child needs to become the engine (the server's serve() returns it in the child only)."""

    run: Run
    command: PythonCommand
    fds: list[int]  # received, in the order of run.fds
    launcher: str  # the spawn executable for its multiprocessing children ("" for none)
    learn_dir: str = ""  # where it records the modules it imports (learned.py; "" for nowhere)


def become(job: Forked) -> int:
    """Set up the process, then run the engine's __main__; returns its exit code (exceptions propagate)."""
    try:
        _setup(job)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.write(2, f"weightcache: cannot start {job.run.argv[0]} from the warm interpreter: {e}\n".encode())
        os._exit(EXIT_CANNOT_START)
    if job.learn_dir:
        from .learned import record_later

        record_later(job.learn_dir)
    return _run_main(job)


def _setup(job: Forked) -> None:
    run, cmd = job.run, job.command
    os.setsid()
    install_fds(run.fds, job.fds)
    os.umask(run.umask)
    os.chdir(run.cwd)
    os.environ.clear()
    os.environ.update(run.env)
    _reset_signals(run.ignored_signals)
    _reset_logging()
    _reset_state(job)
    unbuffered = "-u" in cmd.flags or bool(run.env.get("PYTHONUNBUFFERED"))
    for stream, tty_fd in ((sys.stdout, 1), (sys.stderr, 2)):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=tty_fd == 2 or os.isatty(tty_fd), write_through=unbuffered)
    sys.dont_write_bytecode = "-B" in cmd.flags or bool(run.env.get("PYTHONDONTWRITEBYTECODE"))
    warn = cmd.flag("W")
    if warn:
        import warnings

        sys.warnoptions[:] = list(sys.warnoptions) + warn
        warnings._processoptions(warn)
    sys.executable = os.path.abspath(cmd.interpreter)
    sys.orig_argv = list(run.argv)
    if cmd.kind == "module":
        sys.path.insert(0, run.cwd)
    elif cmd.kind == "code":
        sys.path.insert(0, "")
    else:
        sys.path.insert(0, os.path.dirname(os.path.realpath(os.path.join(run.cwd, cmd.target))))
    _set_title(run.argv)


def install_fds(targets: list[int], fds: list[int]) -> None:
    """dup2 each received fd onto its target number (through free numbers above them all, so that no target
    clobbers a received fd still to be placed); stdin/stdout/stderr not given become /dev/null."""
    floor = max(list(targets) + list(fds) + [2]) + 1
    parked = []
    for fd in fds:
        parked.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor))
        os.close(fd)
    for target, fd in zip(targets, parked, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    for std in (0, 1, 2):
        if std not in targets:
            null = os.open(os.devnull, os.O_RDWR)
            if null != std:
                os.dup2(null, std, inheritable=True)
                os.close(null)


def _reset_signals(ignored: list[int]) -> None:
    for sig in _RESET:
        want = _DEFAULT_HANDLERS.get(sig, signal.SIG_DFL)
        if signal.getsignal(sig) is not want:
            signal.signal(sig, want)
    for sig in ignored:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _reset_logging() -> None:
    root = logging.getLogger()
    for h in list(root.handlers):  # a fresh interpreter has none; vLLM's own (on its logger) stay
        root.removeHandler(h)
    root.setLevel(logging.WARNING)


def _reset_state(job: Forked) -> None:
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        with contextlib.suppress(Exception):
            np_random.seed()
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)
    if job.launcher and os.path.exists(job.launcher):
        import multiprocessing

        multiprocessing.set_executable(job.launcher)  # its spawn children come from the warm interpreter too


def _set_title(argv: list[str]) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):
        setproctitle.setproctitle(" ".join(argv))


def _fresh_main(**attrs) -> dict:
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs)
    sys.modules["__main__"] = main
    return main.__dict__


def _forget(name: str) -> None:
    if sys.modules.pop(name, None) is not None and "." in name:
        parent, _, leaf = name.rpartition(".")
        with contextlib.suppress(AttributeError, KeyError):
            delattr(sys.modules[parent], leaf)


def _run_main(job: Forked) -> int:
    cmd = job.command
    if cmd.kind == "module":
        import runpy

        _forget(cmd.target)  # `python -m X` runs X as __main__ only: a later `import X` makes a second copy
        sys.argv = ["-m", *cmd.args]
        _fresh_main()
        run_as_main = getattr(runpy, "_run_module_as_main", None)
        if run_as_main is not None:
            run_as_main(cmd.target, alter_argv=True)  # what `python -m` itself calls
        else:  # pragma: no cover
            runpy.run_module(cmd.target, run_name="__main__", alter_sys=True)
        return 0
    if cmd.kind == "code":
        import warnings

        # multiprocessing's spawn children re-run the parent's main module as __mp_main__: warm, it is imported
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning, module="runpy")
        sys.argv = ["-c", *cmd.args]
        g = _fresh_main(__builtins__=builtins)
        exec(compile(cmd.target, "<string>", "exec", dont_inherit=True), g)
        return 0
    path = cmd.target
    sys.argv = [path, *cmd.args]
    with io.open_code(os.path.join(job.run.cwd, path)) as f:
        source = f.read()
    g = _fresh_main(__builtins__=builtins, __file__=path, __cached__=None)
    exec(compile(source, path, "exec", dont_inherit=True), g)
    return 0
