"""What a checkpoint is, by content: digests of its files (remembered by stat), of the whole checkpoint and of configurations."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from .progress import Progress

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHECKPOINT_METADATA = ("config.json", "generation_config.json", "model.safetensors.index.json")


def digest_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weightcache" / "digests.json"


_cache_lock = threading.Lock()


def _load_digest_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store_digest_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-hash next time


def _hf_blob_digest(path: Path) -> str | None:
    """A Hugging Face cache stores LFS files as blobs named by their sha256."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and len(target.name) == 64:
        try:
            int(target.name, 16)
        except ValueError:
            return None
        return "sha256:" + target.name
    return None


def _sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return "sha256:" + h.hexdigest()


HASH_THREADS = 16
_LOG_HASHING_FROM = 1 << 30


def _hash_files(paths: list[Path], sizes: list[int]) -> list[str]:
    """sha256 of several files at once, one thread a file (hashlib and reads release the GIL)."""
    total = sum(sizes)
    threads = max(1, min(len(paths), HASH_THREADS))  # a cold disk needs reads in flight beyond the cores
    shown = total >= _LOG_HASHING_FROM
    if shown:
        log.info("hashing %.1f GB in %d checkpoint file(s) for the cache key, %d thread(s) (once: remembered "
                 "by stat)", total / 1e9, len(paths), threads)
    meter = Progress(total, "hashing the checkpoint", shown, log)  # its last line gives the rate
    try:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wc-hash") as pool:
            # largest first: the longest hashes start at once
            order = sorted(range(len(paths)), key=lambda i: -sizes[i])
            done = dict(zip(order, pool.map(lambda i: _sha256_file(paths[i], meter.update), order), strict=True))
    finally:
        meter.close()
    return [done[i] for i in range(len(paths))]


def file_digests(paths: list[Path]) -> list[str]:
    """sha256 of each file's bytes (HF blob names reused), files hashed in parallel; remembered in the digest
    cache by (path, size, mtime_ns, inode), so a second call only stats. The cache is read and written once."""
    with _cache_lock:
        cache = _load_digest_cache(digest_cache_path())
    out: list[str | None] = []
    fresh, todo = {}, []  # todo: (index in out, path, real path, stamp, size)
    for path in map(Path, paths):
        blob = _hf_blob_digest(path)
        if blob:
            out.append(blob)
            continue
        st = os.stat(path)
        real = os.path.realpath(path)
        stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        hit = cache.get(real)
        if hit and hit.get("stamp") == stamp:
            out.append(hit["digest"])
        else:
            todo.append((len(out), path, real, stamp, st.st_size))
            out.append(None)
    if todo:
        digests = _hash_files([t[1] for t in todo], [t[4] for t in todo])
        for (i, _, real, stamp, _), digest in zip(todo, digests, strict=True):
            out[i] = digest
            fresh[real] = {"stamp": stamp, "digest": digest}
    if fresh:
        with _cache_lock:
            merged = _load_digest_cache(digest_cache_path())
            merged.update(fresh)
            _store_digest_cache(digest_cache_path(), merged)
    return out


def file_digest(path: str | Path) -> str:
    return file_digests([Path(path)])[0]


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    files = sorted(
        p for p in path.iterdir()
        if p.is_file() and (p.name.endswith(CHECKPOINT_SUFFIXES) or p.name in CHECKPOINT_METADATA)
    )
    if not any(p.name.endswith(CHECKPOINT_SUFFIXES) for p in files):
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin, ...) in {path}")
    return files


def checkpoint_digest(path: str | Path) -> str:
    """Digest of a checkpoint's content: every weight file's bytes and the model's config."""
    files = checkpoint_files(path)
    h = hashlib.sha256()
    for f, digest in zip(files, file_digests(files), strict=True):
        h.update(f.name.encode() + b"\0" + digest.encode() + b"\n")
    return "sha256:" + h.hexdigest()


def config_digest(obj) -> str:
    """Stable digest of a JSON-able configuration (e.g. a quantization config); "none" for None."""
    if obj is None:
        return "none"
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]
