"""What a preload that became READY leaves behind for its own restart: its command line, the layout and key of
every local rank, and a stamp of every checkpoint file. A preload started again with the same arguments in the
same environment, over files whose stamps did not change, whose caches the custodian still holds, needs none of
this again: it comes back without importing the engine (vLLM, transformers, torch) or building its config
(``restart.py``). Anything else takes the full path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import msgspec

from ..digests import CHECKPOINT_METADATA, CHECKPOINT_SUFFIXES

log = logging.getLogger("weightcache.supervisor")

FORMAT = 1
PREFIX = "preload-"
# the environment that changes what a preload builds (devices, the engine's and weightcache's settings)
ENV_PREFIXES = ("CUDA_", "VLLM_", "HF_", "TRANSFORMERS_", "WEIGHTCACHE_", "PYTORCH_", "NCCL_", "TORCH_")
ENV_NAMES = ("PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")
SKIP_ENV = ("WEIGHTCACHE_NO_FAST_RESTART",)


def relevant_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items())
            if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and k not in SKIP_ENV}


_AT_START: dict = {}


def note_start() -> None:
    """Remember the environment and directory the command started with: engines imported later set variables
    of their own (vLLM's, torch's), and the record must name the preload as the user started it."""
    _AT_START.update(env=relevant_env(), cwd=os.getcwd())


def record_id(argv: list[str], cwd: str | None = None, environ=None) -> str:
    """Which preload this is: its arguments, working directory, Python and relevant environment (as the
    command started, where ``note_start`` ran)."""
    from ..key import ABI_VERSION

    env = relevant_env(environ) if environ is not None or "env" not in _AT_START else _AT_START["env"]
    what = {"argv": list(argv), "cwd": cwd or _AT_START.get("cwd") or os.getcwd(), "python": sys.executable,
            "env": env, "abi": ABI_VERSION}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def record_path(socket_dir: str | Path, rid: str) -> Path:
    return Path(socket_dir) / f"{PREFIX}{rid}.json"


def file_stamp(path: Path) -> list[int]:
    """What must not change for a cache to still be the checkpoint's (ctime too: mtime can be restored)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def checkpoint_stamps(paths) -> dict[str, list[int]]:
    out = {}
    for d in paths:
        d = Path(d)
        files = [d] if d.is_file() else sorted(p for p in d.iterdir() if p.is_file() and (
            p.name.endswith(CHECKPOINT_SUFFIXES) or p.name in CHECKPOINT_METADATA or p.name.endswith(".json")))
        for f in files:
            out[str(f.resolve())] = file_stamp(f)
    return out


@dataclasses.dataclass
class Record:
    rid: str
    argv: list[str]
    socket_dir: str
    checkpoints: list[str]
    stamps: dict[str, list[int]]
    groups: list[dict]  # role, layout (class and fields), master address, info, ranks: [{rank, key, socket, gpu}]
    options: dict  # the --weight-cache-* options the supervisor ran with
    created_at: float = 0.0
    format: int = FORMAT

    def names(self) -> set[str]:
        return {Path(r["socket"]).name for g in self.groups for r in g["ranks"]}

    def stale_stamps(self) -> list[str]:
        """Checkpoint files that changed (or vanished, or appeared) since the record was made."""
        try:
            now = checkpoint_stamps(self.checkpoints)
        except OSError as e:
            return [f"{e.filename}: {e.strerror}"]
        changed = [f for f in set(now) | set(self.stamps) if now.get(f) != self.stamps.get(f)]
        return sorted(changed)


def write(record: Record) -> None:
    path = record_path(record.socket_dir, record.rid)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dataclasses.asdict(record), indent=1, sort_keys=True))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the restart record %s (%s): a restart will take the full path", path, e)


def read(socket_dir: str | Path, rid: str) -> Record | None:
    path = record_path(socket_dir, rid)
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or not os.path.isfile(path) or os.path.islink(path):
            return None
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            return None
        return Record(**raw)
    except (OSError, ValueError, TypeError):
        return None


def remove(socket_dir: str | Path, rid: str) -> None:
    try:
        record_path(socket_dir, rid).unlink()
    except OSError:
        pass


def layout_fields(layout) -> dict:
    return {"class": type(layout).__name__, "fields": dataclasses.asdict(layout)}


def layout_from(fields: dict):
    from .layout import Layout

    cls = Layout
    if fields["class"] != "Layout":
        from .layout import LoopbackLayout

        cls = LoopbackLayout
    return cls(**fields["fields"])


def write_for(remember: dict, groups, children, *, socket_dir, options: dict) -> None:
    """The record of a preload that just became READY: ``remember`` is its front end's {"argv", "checkpoints",
    "stamps"}; none is written if a checkpoint file changed while it loaded."""
    try:
        unchanged = checkpoint_stamps(remember["checkpoints"]) == remember["stamps"]
    except OSError:
        unchanged = False
    if not unchanged:
        log.warning("the checkpoint changed while it loaded: no restart record (the next start loads again)")
        return
    rows = []
    for g in groups:
        mine = [c for c in children if c.spec.role == g.role]
        rows.append({"role": g.role, "layout": layout_fields(g.layout), "master_addr": g.master_addr,
                     "master_port": g.master_port if g.layout.nodes > 1 else 0, "info": dict(g.info),
                     "ranks": [{"rank": c.spec.placement.rank, "key": msgspec.to_builtins(c.key),
                                "socket": c.socket, "gpu_uuid": c.gpu_uuid} for c in mine]})
    write(Record(rid=record_id(remember["argv"]), argv=list(remember["argv"]), socket_dir=str(socket_dir),
                 checkpoints=[str(c) for c in remember["checkpoints"]], stamps=remember["stamps"], groups=rows,
                 options=options, created_at=time.time()))
