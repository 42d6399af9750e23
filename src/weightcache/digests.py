"""What a checkpoint is, by content: a digest of each file (BLAKE3 over 16 MiB chunks, hashed in parallel over
files and chunks), remembered by a stat stamp that no user can restore, and the digest of the whole checkpoint.

Format (a new prefix whenever it changes, so digests of two formats never compare equal):
  file        "blake3-tree-16m:" + hex BLAKE3(FILE_TAG + u64le(size) + u64le(CHUNK) + leaf_0 + ... + leaf_n-1),
              leaf_i = BLAKE3(bytes [i*CHUNK, (i+1)*CHUNK)), n = ceil(size / CHUNK) (none for an empty file)
  checkpoint  "blake3:" + hex BLAKE3(CHECKPOINT_TAG + for each file, by name: name + b"\\0" + file digest + b"\\n")
Without the blake3 package, SHA-256 takes its place ("sha256-tree-16m:" and "sha256-tree:"), four times slower.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .errors import WeightCacheError
from .progress import Progress

log = logging.getLogger("weightcache.digests")  # the same name when run as the hashing process

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHECKPOINT_METADATA = ("config.json", "generation_config.json", "model.safetensors.index.json")

CHUNK = 16 << 20  # part of the format: a chunk is one leaf and one task for a hashing thread
READ = 1 << 20  # one pread: small enough to stay in a core's cache while it is hashed
FILE_TAG = b"weightcache file tree v1\n"
CHECKPOINT_TAG = b"weightcache checkpoint v2\n"
RECENT_NS = 1_000_000_000  # a file changed this shortly before its hash began is hashed again next time
_LOG_HASHING_FROM = 1 << 30
_pread = os.preadv  # one name for tests to wrap


class DigestError(WeightCacheError, OSError):
    """A checkpoint file could not be hashed (unreadable, or it changed while it was read)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


# --- the hash functions ---------------------------------------------------------------------------------

_warned_no_blake3 = False


def algorithm() -> str:
    """'blake3', or 'sha256' where the blake3 package is missing."""
    global _warned_no_blake3
    try:
        import blake3  # noqa: F401
    except ImportError:
        if not _warned_no_blake3:
            _warned_no_blake3 = True
            log.warning("the blake3 package is missing: checkpoints are hashed with SHA-256 (about 4x slower, "
                        "and other digests than where blake3 is installed); pip install blake3")
        return "sha256"
    return "blake3"


def new_hasher(algo: str):
    if algo == "blake3":
        import blake3

        return blake3.blake3()  # one thread: the parallelism is ours, over chunks
    return hashlib.sha256()


def file_prefix(algo: str) -> str:
    return f"{algo}-tree-16m:"


def checkpoint_prefix(algo: str) -> str:
    return "blake3:" if algo == "blake3" else f"{algo}-tree:"


def tree_digest(algo: str, size: int, leaves: Iterable[bytes]) -> str:
    """A file's digest from its size and the digests of its chunks, in order."""
    h = new_hasher(algo)
    h.update(FILE_TAG + size.to_bytes(8, "little") + CHUNK.to_bytes(8, "little"))
    for leaf in leaves:
        h.update(leaf)
    return file_prefix(algo) + h.hexdigest()


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# --- the stamp a digest is remembered by ----------------------------------------------------------------

def stamp_of(st: os.stat_result) -> str | None:
    """What must be unchanged for a remembered digest to hold: size, mtime, ctime (set by the kernel on any
    write or utime, and no user can set it back), inode and device. None where the file system cannot tell."""
    if st.st_ctime_ns == 0 or st.st_ino == 0:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"


def digest_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weightcache" / "digests-v2.json"


_warned_store = False


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remembered(cache: dict, real: str, stamp: str | None, algo: str) -> str | None:
    hit = cache.get(real)
    if stamp is None or not isinstance(hit, dict) or hit.get("stamp") != stamp:
        return None
    digest = hit.get("digest")
    return digest if isinstance(digest, str) and digest.startswith(file_prefix(algo)) else None


def _store_cache(path: Path, fresh: dict) -> None:
    """Merge `fresh` into the cache file under an flock, replaced atomically; a read-only home costs only a
    re-hash next time (said once)."""
    global _warned_store
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = _load_cache(path)
            merged.update(fresh)
            tmp.write_text(json.dumps(merged, sort_keys=True))
            os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not _warned_store:
            _warned_store = True
            log.info("cannot remember checkpoint digests in %s (%s): they are hashed again next time", path, e)


# --- one process hashes a folder at a time --------------------------------------------------------------

@contextlib.contextmanager
def _hashing_lock(folders: list[str], nbytes: int, cancelled: Callable[[], bool]) -> Iterator[None]:
    """flock each folder (sorted: no deadlock), so that the daemons and engines started beside a preload
    that is hashing wait for its digests instead of reading the same files again. Where a file system has
    no flock, or a holder takes far longer than any hash should, it goes on without."""
    held = []
    deadline = time.monotonic() + 60 + nbytes / 250e6
    try:
        for folder in folders:
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            said = time.monotonic() + 10.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.append(fd)
                    break
                except BlockingIOError:
                    if cancelled():
                        os.close(fd)
                        raise concurrent.futures.CancelledError() from None
                    now = time.monotonic()
                    if now > deadline:
                        log.warning("another process has hashed in %s for too long: hashing here as well", folder)
                        os.close(fd)
                        break
                    if said and now > said:
                        said = 0
                        log.info("another process is hashing files in %s: waiting for its digests", folder)
                    time.sleep(0.02)
                except OSError:  # no flock here (some network file systems)
                    os.close(fd)
                    break
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing releases the flock


# --- hashing: a pool of threads over (file, chunk) tasks, in order --------------------------------------

class _File:
    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        self.nchunks = -(-size // CHUNK)
        self.leaves: list[bytes | None] = [None] * self.nchunks
        self.left = max(1, self.nchunks)  # an empty file is one task of no bytes (opened, checked)
        self.fd = -1
        self.stamp: str | None = None
        self.started_ns = 0
        self.digest = ""
        self.cacheable = False


class _Job:
    """Threads take (file, chunk) tasks in order. A failure stops the tasks after it while those before it
    finish, so the error raised is the first one in file order, whatever the threads' timing."""

    def __init__(self, files: list[_File], algo: str, threads: int, nice: int, meter: Progress,
                 cancelled: Callable[[], bool]):
        self.files, self.algo, self.nice, self.meter, self.cancelled = files, algo, nice, meter, cancelled
        self.tasks = [(f, c) for f in files for c in range(max(1, f.nchunks))]
        self.threads = max(1, min(threads, len(self.tasks)))
        self.next = 0
        self.failed_at = len(self.tasks)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[tuple[int, BaseException]] = []

    def run(self) -> None:
        workers = [threading.Thread(target=self._work, name=f"wc-hash-{i}", daemon=True)
                   for i in range(self.threads)]
        try:
            for w in workers:
                w.start()
        finally:
            for w in workers:
                if w.ident is not None:
                    w.join()
            for f in self.files:
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1
        if self.errors:
            raise min(self.errors, key=lambda e: e[0])[1]
        if self.stop.is_set():
            raise concurrent.futures.CancelledError()

    def _stopped(self, idx: int) -> bool:
        if not self.stop.is_set() and self.cancelled():
            self.stop.set()
        return self.stop.is_set() or idx > self.failed_at

    def _lower_priority(self) -> None:
        if self.nice > 0 and sys.platform.startswith("linux"):  # per thread on Linux only
            with contextlib.suppress(OSError):
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))

    def _work(self) -> None:
        self._lower_priority()
        buf = memoryview(bytearray(min(READ, CHUNK)))
        while True:
            with self.lock:
                idx = self.next
                if idx >= self.failed_at or self._stopped(idx):
                    return
                f, c = self.tasks[idx]
                self.next += 1
            try:
                with self.lock:
                    if f.fd < 0:
                        self._open(f)
                leaf = self._chunk(f, c, buf, idx)
                if leaf is None:
                    return
                with self.lock:
                    if c < f.nchunks:
                        f.leaves[c] = leaf
                    f.left -= 1
                    if f.left == 0:
                        self._finish(f)
            except BaseException as e:  # noqa: BLE001 - raised by run(), the first in file order
                with self.lock:
                    self.errors.append((idx, e))
                    self.failed_at = min(self.failed_at, idx)
                return

    def _open(self, f: _File) -> None:
        f.started_ns = time.time_ns()
        try:
            f.fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: an error, no hang
            st = os.fstat(f.fd)
        except OSError as e:
            raise DigestError(f"cannot read {f.path} to hash it: {e.strerror or e}", e.errno) from None
        if not stat.S_ISREG(st.st_mode):
            raise DigestError(f"cannot read {f.path} to hash it: not a regular file", errno.EINVAL)
        f.stamp = stamp_of(st)
        if st.st_size != f.size:
            raise _changed(f)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a cold disk reads further ahead

    def _chunk(self, f: _File, c: int, buf: memoryview, idx: int) -> bytes | None:
        h = new_hasher(self.algo)
        off, end = c * CHUNK, min(f.size, (c + 1) * CHUNK)
        while off < end:
            if self._stopped(idx):
                return None
            want = buf[: min(len(buf), end - off)]
            try:
                n = _pread(f.fd, [want], off)
            except OSError as e:
                raise DigestError(f"cannot read {f.path} to hash it: {e.strerror or e}", e.errno) from None
            if n <= 0:
                raise _changed(f)
            h.update(want[:n])
            off += n
            self.meter.update(n)
        return h.digest()

    def _finish(self, f: _File) -> None:
        st = os.fstat(f.fd)
        os.close(f.fd)
        f.fd = -1
        if stamp_of(st) != f.stamp or st.st_size != f.size:
            raise _changed(f)
        f.digest = tree_digest(self.algo, f.size, f.leaves)  # type: ignore[arg-type]
        # a change within the clock's tick before the hash began could leave the stamp as it was: not kept
        f.cacheable = f.stamp is not None and st.st_ctime_ns < f.started_ns - RECENT_NS


def _changed(f: _File) -> DigestError:
    return DigestError(f"{f.path} changed while it was being hashed: hash it again once it is written",
                       errno.EAGAIN)


def _hash_files(files: list[_File], algo: str, threads: int, nice: int, cancelled: Callable[[], bool]) -> None:
    total = sum(f.size for f in files)
    shown = total >= _LOG_HASHING_FROM
    job = _Job(files, algo, threads, nice, Progress(total, "hashing the checkpoint", shown, log), cancelled)
    if shown:
        log.info("hashing %.1f GB in %d checkpoint file(s) for the cache key on %d thread(s) (once: remembered "
                 "by stat)", total / 1e9, len(files), job.threads)
    t0 = time.monotonic()
    try:
        job.run()
    finally:
        job.meter.close()
    dt = max(time.monotonic() - t0, 1e-9)
    log.log(logging.INFO if shown else logging.DEBUG, "hashed %.2f GB in %.2f s: %.2f GB/s (%s, %d thread(s))",
            total / 1e9, dt, total / dt / 1e9, algo, job.threads)


# --- the public API -------------------------------------------------------------------------------------

def _never() -> bool:
    return False


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as e:
        raise DigestError(f"cannot read {path} to hash it: {e.strerror or e}", e.errno) from None


def file_digests(paths: Iterable[str | Path], *, threads: int | None = None, nice: int = 0,
                 cancelled: Callable[[], bool] = _never) -> list[str]:
    """The digest of each file's bytes, in order. Remembered in the digest cache by (real path, stamp_of), so
    a second call only stats; anything else is hashed, on `threads` threads (default: every core), each
    `nice` steps below the caller's priority. Raises DigestError (an OSError) naming the file, or
    CancelledError within one read per thread once `cancelled()` is true."""
    paths = [Path(p) for p in paths]
    algo = algorithm()
    cache_path = digest_cache_path()
    out: list[str | None] = [None] * len(paths)
    reals = [os.path.realpath(p) for p in paths]
    todo = []
    cache = _load_cache(cache_path)
    for i, p in enumerate(paths):
        out[i] = _remembered(cache, reals[i], stamp_of(_stat(p)), algo)
        if out[i] is None:
            todo.append(i)
    if todo:
        folders = sorted({os.path.dirname(reals[i]) for i in todo})
        nbytes = sum(_stat(paths[i]).st_size for i in todo)
        with _hashing_lock(folders, nbytes, cancelled):
            cache = _load_cache(cache_path)  # another process may have hashed them meanwhile
            files = {}
            for i in todo:
                out[i] = _remembered(cache, reals[i], stamp_of(_stat(paths[i])), algo)
                if out[i] is None:
                    files[i] = _File(paths[i], _stat(paths[i]).st_size)
            if files:
                order = sorted(files, key=lambda i: reals[i])  # one order everywhere: a pool reads ahead in it
                _hash_files([files[i] for i in order], algo, threads or default_threads(), nice, cancelled)
                fresh = {}
                for i, f in files.items():
                    out[i] = f.digest
                    if f.cacheable:
                        fresh[reals[i]] = {"stamp": f.stamp, "digest": f.digest}
                if fresh:
                    _store_cache(cache_path, fresh)  # before the lock is released: waiters find them
    return out  # type: ignore[return-value]


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


def safetensors_bytes(path: str | Path) -> int:
    """Bytes of a local checkpoint's safetensors files, what a load reads (0 for a name that is no local
    directory, such as a hub id)."""
    d = Path(path)
    return sum(f.stat().st_size for f in d.glob("*.safetensors") if f.is_file()) if d.is_dir() else 0


def combine(algo: str, names: Iterable[str], digests: Iterable[str]) -> str:
    """The checkpoint's digest from its files' names and digests, in name order."""
    h = new_hasher(algo)
    h.update(CHECKPOINT_TAG)
    for name, digest in zip(names, digests, strict=True):
        h.update(name.encode() + b"\0" + digest.encode() + b"\n")
    return checkpoint_prefix(algo) + h.hexdigest()


def checkpoint_digest(path: str | Path, *, threads: int | None = None, nice: int = 0,
                      cancelled: Callable[[], bool] = _never) -> str:
    """Digest of a checkpoint's content: every weight file's bytes and the model's config. Blocks; only stats
    when every file's digest is remembered. See `start_checkpoint_digest` to hash beside a load."""
    files = checkpoint_files(path)
    digests = file_digests(files, threads=threads, nice=nice, cancelled=cancelled)
    return combine(algorithm(), [f.name for f in files], digests)


def remembered_checkpoint_digest(path: str | Path) -> str | None:
    """The checkpoint's digest if every file's is remembered under its current stamp (stats only), else None."""
    files = checkpoint_files(path)
    algo = algorithm()
    cache = _load_cache(digest_cache_path())
    digests = [_remembered(cache, os.path.realpath(f), stamp_of(_stat(f)), algo) for f in files]
    if any(d is None for d in digests):
        return None
    return combine(algo, [f.name for f in files], digests)  # type: ignore[arg-type]


def start_checkpoint_digest(path: str | Path, *, threads: int | None = None, nice: int = 0,
                            in_a_process: bool = False) -> concurrent.futures.Future[str]:
    """Hash a checkpoint on background threads; returns at once with a Future of `checkpoint_digest(path)`.

    A missing checkpoint raises here; read errors (DigestError) come out of `result()`. `threads` caps the
    hashing threads (default: every core) and `nice` lowers their priority, so that a load running meanwhile
    keeps its share of the CPU. `cancel()` stops the hashing within one read (1 MiB per thread). The digests
    are remembered before the Future completes, and any process that asks for the same files meanwhile
    (`checkpoint_digest` in a daemon or an engine) waits for them instead of hashing again.

    With ``in_a_process`` the threads run in a process of their own (``python -m weightcache.digests``): each of
    them takes the GIL once per read, and beside a busy main thread (a preload's start) that GIL, not the
    memory, sets the rate. `cancel()` then ends that process; so does this one's death."""
    files = checkpoint_files(path)
    fut: concurrent.futures.Future[str] = concurrent.futures.Future()  # pending until done: cancel() works
    if in_a_process:
        _start_hashing_process(Path(path), threads, nice, fut)
        return fut

    def run() -> None:
        try:
            digests = file_digests(files, threads=threads, nice=nice, cancelled=fut.cancelled)
            result = combine(algorithm(), [f.name for f in files], digests)
        except concurrent.futures.CancelledError:
            fut.set_running_or_notify_cancel()
            return
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the Future
            if fut.set_running_or_notify_cancel():
                fut.set_exception(e)
            return
        if fut.set_running_or_notify_cancel():
            fut.set_result(result)

    threading.Thread(target=run, name="wc-digest", daemon=True).start()
    return fut


def _start_hashing_process(path: Path, threads: int | None, nice: int, fut: concurrent.futures.Future) -> None:
    """`python -m weightcache.digests` hashes `path` and writes one JSON line: {"digest"} or {"error", "errno"}.
    It watches a pipe whose other end only this process holds: it ends when this process does."""
    life_r, life_w = os.pipe()
    argv = [sys.executable, "-m", "weightcache.digests", str(path), "--nice", str(nice), "--lifeline", str(life_r),
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
    if threads:
        argv += ["--threads", str(threads)]
    env = dict(os.environ)  # what this process imports (weightcache, blake3), wherever it found them
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, pass_fds=(life_r,), env=env)
    except OSError as e:
        os.close(life_w)
        raise DigestError(f"cannot start hashing {path}: {e}", e.errno) from None
    finally:
        os.close(life_r)

    def wait() -> None:
        out = b""
        try:
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], 0.05)
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 1 << 16)
                    if not chunk:
                        break
                    out += chunk
                elif fut.cancelled():
                    proc.kill()
                    break
            proc.wait()
        finally:
            proc.stdout.close()
            os.close(life_w)
        if not fut.set_running_or_notify_cancel():
            return
        try:
            reply = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            reply = {"error": f"hashing {path} ended with exit status {proc.returncode} and no digest"}
        if isinstance(reply.get("digest"), str):
            fut.set_result(reply["digest"])
        else:
            fut.set_exception(DigestError(str(reply.get("error")), reply.get("errno")))

    threading.Thread(target=wait, name="wc-digest", daemon=True).start()


def _main(argv: list[str] | None = None) -> int:
    """The hashing process of ``start_checkpoint_digest(..., in_a_process=True)``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m weightcache.digests")
    ap.add_argument("path")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--lifeline", type=int, default=None)
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [hash] %(name)s: %(message)s")
    if a.lifeline is not None:
        def watch() -> None:
            with contextlib.suppress(OSError):
                while os.read(a.lifeline, 1 << 10):
                    pass
            os._exit(1)  # the process that asked is gone

        threading.Thread(target=watch, name="wc-lifeline", daemon=True).start()
    try:
        reply = {"digest": checkpoint_digest(a.path, threads=a.threads, nice=a.nice)}
    except OSError as e:
        reply = {"error": str(e), "errno": e.errno}
    print(json.dumps(reply), flush=True)
    return 0 if "digest" in reply else 1


def config_digest(obj) -> str:
    """Stable digest of a JSON-able configuration (e.g. a quantization config); "none" for None."""
    if obj is None:
        return "none"
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


if __name__ == "__main__":
    sys.exit(_main())
