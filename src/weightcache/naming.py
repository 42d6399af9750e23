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


def default_socket_dir_path() -> Path:
    """The per-user socket directory, not created."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "weightcache" if runtime and os.path.isdir(runtime) else Path(f"/tmp/weightcache-{os.getuid()}")


def default_socket_dir() -> Path:
    return ensure_private_dir(default_socket_dir_path())


def check_private_dir(path: str | Path) -> Path:
    """An existing socket directory must be ours and not writable by others (anyone who can write it can
    put a socket of their own in a daemon's place)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise WeightCacheError(f"socket directory {path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WeightCacheError(f"socket directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise WeightCacheError(f"socket directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise WeightCacheError(f"socket directory {path} is writable by others (mode {oct(st.st_mode & 0o777)}); "
                               "use a directory only its owner can write (chmod 700)")
    return path


def ensure_private_dir(path: str | Path) -> Path:
    """Create (0700) or check a socket directory: ours, not writable by others, and one we can create
    sockets in (not on a read-only filesystem)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise WeightCacheError(f"cannot create socket directory {path}: {e.strerror}") from None
    check_private_dir(path)
    try:
        read_only = os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        read_only = False
    if read_only:
        raise WeightCacheError(f"socket directory {path} is on a read-only filesystem: sockets cannot be created "
                               "there; pick another directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise WeightCacheError(f"socket directory {path} is not writable by uid {os.getuid()}")
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
    check_socket_path(path)
    return path


def check_socket_path(path: str | Path) -> None:
    n = len(os.fsencode(str(path)))
    if n > MAX_SOCKET_PATH:
        raise WeightCacheError(f"socket path {path} is {n} bytes, over the {MAX_SOCKET_PATH}-byte limit of Unix "
                               "sockets; use a shorter socket directory")


def longest_socket_path(socket_dir: str | Path, roles: list[str], world_size: int, device_type: str) -> Path:
    """The longest path a daemon of these roles and ranks will bind in `socket_dir` (for refusing a too
    long directory before anything starts)."""
    tag = "cpu" if device_type == "cpu" else "0" * 8
    role = max(roles, key=len)
    return Path(socket_dir) / f"{role}-r{max(world_size - 1, 0)}-{tag}-{'0' * 8}.sock"
