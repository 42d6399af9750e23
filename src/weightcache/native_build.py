"""C loops built with the machine's C compiler on first use, cached under ~/.cache/weightcache/native (one library
per version of the source and flags) and loaded with ctypes: no compiler needed at install, one clear reason
where none is there."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "WEIGHTCACHE_NATIVE_DIR"


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightcache" / "native"


def built_name(source: Path, cflags: list[str]) -> str:
    """The library's file name in the cache: one per version of the source and flags."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(cflags).encode()).hexdigest()[:16]
    return f"{source.stem}-{digest}.so"


def build(source: Path, cflags: list[str], libs: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    out = cache_dir() / built_name(source, cflags)
    try:
        if not out.exists():
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not cc:
                return None, "no C compiler"
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                built = Path(tmp) / out.name
                proc = subprocess.run([cc, *cflags, "-o", str(built), str(source), *libs], capture_output=True,
                                      text=True, timeout=120)
                if proc.returncode != 0:
                    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
                    return None, f"{cc} failed: {last}"
                os.replace(built, out)
        return ctypes.CDLL(str(out)), ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
