"""Sockets, the one place that knows their names: where they live (a private per-user directory), what a
daemon's socket is called (role, rank, GPU and cache identity), the custodian's and the warm engine
interpreter's, parsing a name back, finding a daemon's socket, and probing for stale ones. Imports no torch
until a GPU's tag is asked for."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import stat
from pathlib import Path

from .errors import DaemonUnavailable, SocketInUse, WeightCacheError
from .key import CacheKey

log = logging.getLogger("weightcache.sockets")

MAX_SOCKET_PATH = 107
SUFFIX = ".sock"  # daemons' sockets; the custodian's is not one (`status` and engines list daemons by it)
CUSTODIAN_NAME = "custodian.ctl"
WARM_NAME = "warm.ctl"  # the warm engine interpreter (warm/server.py)
_DAEMON_NAME = re.compile(r"^(?P<role>[a-z]+)-r(?P<rank>\d+)-(?P<dev>[0-9a-z]+)-(?P<hash>[0-9a-f]+)\.sock$")


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
    """"cpu", or a short hash of the GPU's UUID (indices change with CUDA_VISIBLE_DEVICES, UUIDs do not)."""
    if str(getattr(device, "type", device)) == "cpu":
        return "cpu"
    import torch

    device = torch.device(device)
    from .arena.cuda import gpu_uuid

    index = device.index if device.index is not None else torch.cuda.current_device()
    return tag_of_uuid(gpu_uuid(index))


def tag_of_uuid(uuid: str) -> str:
    """A GPU's short tag in socket names, from its UUID (as torch prints it)."""
    return hashlib.sha256(uuid.encode()).hexdigest()[:8]


def socket_name(key: CacheKey, tag: str) -> str:
    return f"{_prefix(key.role, key.rank, tag)}{key.short_hash()[:8]}{SUFFIX}"


def _prefix(role: str, rank: int, tag: str) -> str:
    return f"{role}-r{rank}-{tag}-"


def parse_socket_name(name: str) -> dict | None:
    """{"role", "rank", "device", "hash"} of a daemon's socket name; None for any other name."""
    m = _DAEMON_NAME.match(name)
    if not m:
        return None
    return {"role": m["role"], "rank": int(m["rank"]), "device": m["dev"], "hash": m["hash"]}


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
    return Path(socket_dir) / f"{_prefix(role, max(world_size - 1, 0), tag)}{'0' * 8}{SUFFIX}"


def custodian_socket_path(socket_dir: str | Path) -> Path:
    return Path(socket_dir) / CUSTODIAN_NAME


def warm_socket_path(socket_dir: str | Path) -> Path:
    return Path(socket_dir) / WARM_NAME


def daemon_sockets(socket_dir: str | Path) -> list[Path]:
    """Every daemon socket file in a directory, sorted by name."""
    socket_dir = Path(socket_dir)
    if not socket_dir.is_dir():
        return []
    return sorted(p for p in socket_dir.glob(f"*{SUFFIX}") if is_socket(p))


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def probe(path: str | Path, timeout: float = 1.0) -> str:
    """"missing", "not_socket", "stale" (nobody listens: its process died) or "live" (something accepts
    connections there); "unknown" when the probe itself failed (then nothing may be removed)."""
    path = Path(path)
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return "not_socket"
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unknown"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return "live"
    except (ConnectionRefusedError, FileNotFoundError):
        return "stale"
    except OSError:
        return "unknown"
    finally:
        s.close()


def take_over_path(path: Path, what: str = "daemon") -> bool:
    """Make `path` free to bind: a stale socket is removed; a live one or another kind of file is refused
    (SocketInUse). False when a live one is there and ``what`` is "custodian" (it is reused, not refused)."""
    state = probe(path)
    if state == "not_socket":
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    if state == "live":
        if what == "custodian":
            return False
        raise SocketInUse(f"a live {what} already serves {path}")
    if state == "unknown":
        raise SocketInUse(f"cannot probe existing socket {path}")
    if state == "stale":
        log.warning("removing stale socket %s (its %s is gone)", path, what)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return True


def remove_if_stale(path: Path) -> bool:
    """Unlink a socket no one listens on any more; True if it was removed."""
    if probe(path) != "stale":
        return False
    with contextlib.suppress(OSError):
        Path(path).unlink()
        return True
    return False


def find_socket(socket_dir: str | Path, key: CacheKey, device_tag: str) -> Path:
    """The socket for this key; else a live one for the same role/rank/device (attach then names the
    differing fields); else DaemonUnavailable saying what was looked for."""
    socket_dir = Path(socket_dir)
    exact = socket_dir / socket_name(key, device_tag)
    if exact.exists():
        return exact
    prefix = _prefix(key.role, key.rank, device_tag)
    candidates = [p for p in daemon_sockets(socket_dir) if p.name.startswith(prefix)]
    for cand in candidates:
        if probe(cand) == "live":
            return cand
    raise DaemonUnavailable(
        f"no weight cache daemon for {key.role} rank {key.rank} on device {device_tag} in {socket_dir} "
        f"(looked for {exact.name}"
        + (f"; stale: {', '.join(c.name for c in candidates)}" if candidates else "")
        + ")"
    )


def socket_in_dir(socket_dir: Path, expect: CacheKey | None, device) -> Path:
    """The one daemon socket of a directory an engine means: by key and device when both are given, else
    the only socket (of the key's role and rank) there."""
    if expect is not None and device is not None:
        return find_socket(socket_dir, expect, device_tag(device))
    socks = daemon_sockets(socket_dir)
    if expect is not None:
        want = f"-{expect.short_hash()[:8]}{SUFFIX}"
        exact = [p for p in socks if p.name.endswith(want)]
        if len(exact) == 1:
            return exact[0]
        socks = exact or [p for p in socks if (parse_socket_name(p.name) or {}).get("role") == expect.role
                          and (parse_socket_name(p.name) or {}).get("rank") == expect.rank]
    if len(socks) == 1:
        return socks[0]
    if not socks:
        raise DaemonUnavailable(f"no weight cache daemon socket in {socket_dir}")
    raise WeightCacheError(
        f"{len(socks)} daemons in {socket_dir} ({', '.join(p.name for p in socks)}): pass expect=<CacheKey> "
        "and device=, or the socket path itself"
    )
