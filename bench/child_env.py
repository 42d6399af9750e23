"""The environment a benchmark gives the processes it starts."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_src_on_path() -> dict:
    """The environment with this checkout's src/ first on PYTHONPATH, keeping what it had (staged packages)."""
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *([old] if old else [])])}
