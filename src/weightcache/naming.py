"""Where sockets live and what they are called: keyed by role, rank, GPU and cache identity."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import torch

from .errors import WeightCacheError
from .key import CacheKey

MAX_SOCKET_PATH = 107


def default_socket_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "weightcache" if runtime and os.path.isdir(runtime) else Path(f"/tmp/weightcache-{os.getuid()}")
    return ensure_private_dir(base)


def ensure_private_dir(path: str | Path) -> Path:
    """Create (0700) or check a socket directory: ours, and not writable by others."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise WeightCacheError(f"socket directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise WeightCacheError(f"socket directory {path} is writable by others (mode {oct(st.st_mode & 0o777)})")
    return path


def device_tag(device) -> str:
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    from .arena.cuda import gpu_uuid

    index = device.index if device.index is not None else torch.cuda.current_device()
    return hashlib.sha256(gpu_uuid(index).encode()).hexdigest()[:8]


def socket_name(key: CacheKey, tag: str) -> str:
    return f"{key.role}-r{key.rank}-{tag}-{key.short_hash()[:8]}.sock"


def socket_path(socket_dir: str | Path, key: CacheKey, tag: str) -> Path:
    path = Path(socket_dir) / socket_name(key, tag)
    if len(str(path)) > MAX_SOCKET_PATH:
        raise WeightCacheError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter socket dir")
    return path
