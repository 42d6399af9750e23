"""The spawn executable of warm engines: vLLM starts its engine core and workers with multiprocessing
"spawn" (a fresh interpreter that imports vLLM again); an engine started warm points multiprocessing at this
small script instead, which asks the warm interpreter to fork the child (same argv, environment, cwd and
inherited fds, so multiprocessing's pipes arrive at their numbers) and stands in for it: signals forwarded,
its exit status returned, its death kills the child. With no warm interpreter it execs Python itself, as
spawn would have."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

LAUNCHER_NAME = "warm-python"


def launcher_path(socket_path: str | Path) -> Path:
    return Path(socket_path).parent / LAUNCHER_NAME


def write_launcher(socket_path: str | Path) -> str:
    """Write the launcher script next to the warm socket (atomically); "" if the directory cannot run it."""
    path = launcher_path(socket_path)
    try:
        if os.statvfs(path.parent).f_flag & getattr(os, "ST_NOEXEC", 8):
            return ""
    except OSError:
        return ""
    import weightcache

    package_root = str(Path(weightcache.__file__).resolve().parent.parent)
    code = (f"import sys; sys.path.insert(0, {package_root!r}); "
            "from weightcache.warm.launcher import main; sys.exit(main())")
    text = (f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)} "
            f"{shlex.quote(str(socket_path))} \"$@\"\n")
    tmp = path.with_name(f".{LAUNCHER_NAME}.{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return str(path)


def main() -> int:
    """argv: SOCKET ARGS... (ARGS as spawn gives them to Python)."""
    from .client import launch_python

    socket_path, args = sys.argv[1], sys.argv[2:]
    return launch_python(socket_path, args)
