"""The environment a benchmark gives the processes it starts."""

from __future__ import annotations

import os
import signal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_src_on_path() -> dict:
    """The environment with this checkout's src/ first on PYTHONPATH, keeping what it had (staged packages)."""
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *([old] if old else [])])}


def with_env(base: dict, **extra) -> dict:
    """``with_src_on_path()`` plus a benchmark's own variables (``base``) and a run's (``extra``)."""
    return {**with_src_on_path(), **base, **{k: str(v) for k, v in extra.items()}}


def free_port() -> int:
    """A TCP port free on the loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_and_reap(proc, pids: list[int]) -> None:
    """SIGKILL ``pids`` (a preload's supervisor ``proc`` and its daemons), reap ``proc`` and wait until each is
    gone."""
    import psutil

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    alive = []
    for pid in pids:
        try:
            alive.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=30)
