"""Checkpoint digests: the format (against a computation written out here), chunk boundaries, order, the
parallel pool, the stamp a digest is remembered by, the background Future, and errors."""

import contextlib
import json
import logging
import os
import random
import threading
import time

import blake3
import pytest

from weightcache import digests as dg
from weightcache.digests import DigestError, checkpoint_digest, file_digest, file_digests, safetensors_bytes

MIB16 = 16 << 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def remember_at_once(monkeypatch):
    """Files written by a test are younger than RECENT_NS: let their digests be remembered anyway."""
    monkeypatch.setattr(dg, "RECENT_NS", -(10**18))


def ref_file(data: bytes) -> str:
    """The file digest, written out from the format's definition (not from the module's helpers)."""
    leaves = [blake3.blake3(data[i:i + MIB16]).digest() for i in range(0, len(data), MIB16)]
    head = b"weightcache file tree v1\n" + len(data).to_bytes(8, "little") + MIB16.to_bytes(8, "little")
    return "blake3-tree-16m:" + blake3.blake3(head + b"".join(leaves)).hexdigest()


def ref_checkpoint(named: dict[str, bytes]) -> str:
    body = b"".join(n.encode() + b"\0" + ref_file(named[n]).encode() + b"\n" for n in sorted(named))
    return "blake3:" + blake3.blake3(b"weightcache checkpoint v2\n" + body).hexdigest()


def write(path, data: bytes):
    path.write_bytes(data)
    return path


class Reads:
    """Wraps the module's pread: counts reads, the most at once, and runs a hook before each."""

    def __init__(self, monkeypatch, hook=None):
        self.real, self.hook = dg._pread, hook
        self.n = self.now = self.most = 0
        self.lock = threading.Lock()
        monkeypatch.setattr(dg, "_pread", self)

    def __call__(self, fd, bufs, off):
        with self.lock:
            self.n += 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self.hook is not None:
                self.hook(fd, bufs, off)
            return self.real(fd, bufs, off)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("size", [0, 1, 1000, MIB16 - 1, MIB16, MIB16 + 1, 2 * MIB16, 3 * MIB16 + 12345])
def test_file_digest_matches_the_format(tmp_path, size):
    data = random.Random(size).randbytes(size)
    assert file_digest(write(tmp_path / "f.safetensors", data)) == ref_file(data)


def test_known_answers(tmp_path):
    """Fixed vectors: the format may change only with a new prefix (and key.ABI_VERSION)."""
    pattern = (bytes(range(256)) * (2 * MIB16 // 256 + 1))[:2 * MIB16 + 5]
    want = {b"": "934087d33820cd6f6450c2eda6eed9d7988ea4cb0c8966650c0b209ea557f639",
            b"abc": "c8ad02b4af9859b91ec8e08b2ad7fa140a77f703bc9fd942a12c96683b83c872",
            pattern: "43b2157c418e742976c37ce2da2938fd5ed52715f1cd774ea0df1349a190e809"}
    for i, (data, hexdigest) in enumerate(want.items()):
        assert file_digest(write(tmp_path / f"f{i}", data)) == ref_file(data) == "blake3-tree-16m:" + hexdigest
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write(ckpt / "model.safetensors", b"abc")
    write(ckpt / "config.json", b"{}")
    assert checkpoint_digest(ckpt) == "blake3:6f6579bcc705ae1868b0319d6d7ffb2985ae15e9a1e690842d838ad5829a6475"


def test_chunk_order_and_boundaries_count(tmp_path):
    a, b = random.Random(1).randbytes(MIB16), random.Random(2).randbytes(MIB16)
    ab, ba = file_digest(write(tmp_path / "ab", a + b)), file_digest(write(tmp_path / "ba", b + a))
    assert ab != ba and ab == ref_file(a + b)
    one_more = file_digest(write(tmp_path / "ab0", a + b + b"\0"))
    assert one_more != ab and one_more == ref_file(a + b + b"\0")
    assert file_digest(write(tmp_path / "e", b"")) != file_digest(write(tmp_path / "z", b"\0"))


def test_checkpoint_digest_matches_the_format(tmp_path):
    files = {"model-00001-of-00002.safetensors": random.Random(3).randbytes(MIB16 + 7),
             "model-00002-of-00002.safetensors": random.Random(4).randbytes(999),
             "config.json": b'{"model_type": "llama"}', "model.safetensors.index.json": b"{}"}
    for name, data in files.items():
        write(tmp_path / name, data)
    write(tmp_path / "README.md", b"not part of the content")
    assert checkpoint_digest(tmp_path) == ref_checkpoint(files)
    a, b = sorted(n for n in files if n.startswith("model-"))
    write(tmp_path / a, files[b])
    write(tmp_path / b, files[a])  # the same files, their names swapped: another checkpoint
    assert checkpoint_digest(tmp_path) == ref_checkpoint({**files, a: files[b], b: files[a]})
    assert checkpoint_digest(tmp_path) != ref_checkpoint(files)


def test_one_thread_or_many_give_the_same_digests(tmp_path):
    paths = [write(tmp_path / f"m{i}.safetensors", random.Random(i).randbytes(s))
             for i, s in enumerate([3 * MIB16 + 5, 0, 17, MIB16])]
    one = file_digests(paths, threads=1)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "other-cache")  # nothing remembered: hashed again
    assert file_digests(paths, threads=7) == one == [ref_file(p.read_bytes()) for p in paths]


def test_chunks_of_one_file_are_hashed_at_once(tmp_path, monkeypatch):
    path = write(tmp_path / "big.safetensors", random.Random(5).randbytes(3 * MIB16))
    meet = threading.Barrier(3, timeout=20)  # three chunks of the same file must be read at once, or this breaks

    def first_read_of_a_chunk_waits(fd, bufs, off):
        if off % MIB16 == 0:
            meet.wait()

    Reads(monkeypatch, first_read_of_a_chunk_waits)
    assert file_digests([path], threads=3) == [ref_file(path.read_bytes())]


def test_files_are_hashed_at_once_and_in_order(tmp_path, monkeypatch, caplog):
    paths = [write(tmp_path / f"m{i}.safetensors", random.Random(i).randbytes(s))
             for i, s in enumerate([3 << 20, 1 << 10, 5 << 20])]
    meet = threading.Barrier(3, timeout=20)
    Reads(monkeypatch, lambda fd, bufs, off: meet.wait() if off == 0 else None)
    monkeypatch.setattr(dg, "_LOG_HASHING_FROM", 0)
    with caplog.at_level(logging.INFO, logger="weightcache.digests"):
        got = file_digests(paths, threads=4)
    assert got == [ref_file(p.read_bytes()) for p in paths]
    total = sum(p.stat().st_size for p in paths)
    assert "hashing 0.0 GB in 3 checkpoint file(s) for the cache key on 3 thread(s)" in caplog.text
    assert f"hashing the checkpoint: {total / 1e9:.2f} / {total / 1e9:.2f} GB (100%)" in caplog.text  # meter
    assert f"hashed {total / 1e9:.2f} GB in " in caplog.text and "GB/s (blake3, 3 thread(s))" in caplog.text


def test_thread_cap_and_priority(tmp_path, monkeypatch):
    path = write(tmp_path / "big.safetensors", random.Random(6).randbytes(4 * MIB16))
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = set()
    Reads(monkeypatch, lambda fd, bufs, off: seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    reads = dg._pread
    assert file_digests([path], threads=2, nice=3) == [ref_file(path.read_bytes())]
    assert reads.most <= 2 and seen == {min(19, base + 3)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's thread untouched


def test_without_blake3_sha256_trees_with_their_own_prefix(tmp_path, monkeypatch, caplog):
    import hashlib
    import sys

    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 fails
    monkeypatch.setattr(dg, "_warned_no_blake3", False)
    data = random.Random(14).randbytes(MIB16 + 3)
    write(tmp_path / "model.safetensors", data)
    leaves = hashlib.sha256(data[:MIB16]).digest() + hashlib.sha256(data[MIB16:]).digest()
    head = b"weightcache file tree v1\n" + len(data).to_bytes(8, "little") + MIB16.to_bytes(8, "little")
    want = "sha256-tree-16m:" + hashlib.sha256(head + leaves).hexdigest()
    with caplog.at_level(logging.WARNING, logger="weightcache.digests"):
        assert file_digest(tmp_path / "model.safetensors") == want
        body = b"model.safetensors\0" + want.encode() + b"\n"
        assert checkpoint_digest(tmp_path) == "sha256-tree:" + hashlib.sha256(
            b"weightcache checkpoint v2\n" + body).hexdigest()
    assert caplog.text.count("the blake3 package is missing") == 1


# --- the stamp ------------------------------------------------------------------------------------------

def test_remembered_digest_only_stats(tmp_path, monkeypatch, remember_at_once):
    path = write(tmp_path / "m.safetensors", b"weights" * 1000)
    first = file_digest(path)
    reads = Reads(monkeypatch)
    assert file_digest(path) == first and reads.n == 0
    cache = json.loads(dg.digest_cache_path().read_text())
    st = path.stat()
    assert cache[str(path.resolve())] == {
        "stamp": f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}", "digest": first}


def test_rewritten_in_place_with_mtime_restored_is_hashed_again(tmp_path, monkeypatch):
    """Issue 32, finding 2: the same size, the same inode, the mtime put back with utime."""
    monkeypatch.setattr(dg, "RECENT_NS", 50_000_000)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    model = write(ckpt / "model.safetensors", random.Random(7).randbytes(100_000))
    write(ckpt / "config.json", b"{}")
    time.sleep(0.2)  # older than RECENT_NS: remembered
    old = checkpoint_digest(ckpt)
    reads = Reads(monkeypatch)
    assert checkpoint_digest(ckpt) == old and reads.n == 0
    st = model.stat()
    with open(model, "r+b") as f:
        f.write(random.Random(8).randbytes(100_000))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = model.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    new = checkpoint_digest(ckpt)
    assert new != old and new == ref_checkpoint({"model.safetensors": model.read_bytes(), "config.json": b"{}"})


def test_remembered_checkpoint_digest_only_stats(tmp_path, monkeypatch, remember_at_once):
    write(tmp_path / "model.safetensors", b"m" * 5000)
    write(tmp_path / "config.json", b"{}")
    assert dg.remembered_checkpoint_digest(tmp_path) is None
    reads = Reads(monkeypatch)
    digest = checkpoint_digest(tmp_path)
    n = reads.n
    assert dg.remembered_checkpoint_digest(tmp_path) == digest and reads.n == n > 0
    write(tmp_path / "config.json", b"{ }")
    assert dg.remembered_checkpoint_digest(tmp_path) is None


def test_utime_alone_rehashes_to_the_same_digest(tmp_path, monkeypatch, remember_at_once):
    path = write(tmp_path / "m.safetensors", b"x" * 5000)
    first = file_digest(path)
    os.utime(path, ns=(1, 1))
    reads = Reads(monkeypatch)
    assert file_digest(path) == first and reads.n > 0


def test_a_file_changed_just_before_its_hash_is_not_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(dg, "RECENT_NS", 3600 * 10**9)  # everything is recent
    path = write(tmp_path / "m.safetensors", b"y" * 5000)
    first = file_digest(path)
    reads = Reads(monkeypatch)
    assert file_digest(path) == first and reads.n > 0
    assert not dg.digest_cache_path().exists()


def test_a_remembered_digest_of_another_format_is_not_used(tmp_path, monkeypatch, remember_at_once):
    path = write(tmp_path / "m.safetensors", b"z" * 5000)
    first = file_digest(path)
    cache = dg.digest_cache_path()
    entries = json.loads(cache.read_text())
    entries[str(path.resolve())]["digest"] = "sha256:" + "0" * 64
    cache.write_text(json.dumps(entries))
    assert file_digest(path) == first


def test_hf_blob_names_are_not_trusted(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    write(blobs / ("a" * 64), b"not what the name says")
    os.symlink(blobs / ("a" * 64), snap / "model.safetensors")
    assert file_digest(snap / "model.safetensors") == ref_file(b"not what the name says")


def test_unwritable_or_broken_cache_costs_only_a_rehash(tmp_path, monkeypatch, caplog):
    (tmp_path / "plain-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "plain-file" / "cache"))  # mkdir fails, even as root
    monkeypatch.setattr(dg, "RECENT_NS", -(10**18))
    monkeypatch.setattr(dg, "_warned_store", False)
    path = write(tmp_path / "m.safetensors", b"w" * 5000)
    with caplog.at_level(logging.INFO, logger="weightcache.digests"):
        assert file_digest(path) == file_digest(path) == ref_file(path.read_bytes())
    assert caplog.text.count("cannot remember checkpoint digests") == 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dg.digest_cache_path().parent.mkdir(parents=True)
    dg.digest_cache_path().write_text("[1, 2")  # torn or foreign
    assert file_digest(path) == ref_file(path.read_bytes())
    assert str(path.resolve()) in json.loads(dg.digest_cache_path().read_text())
    assert [p.name for p in dg.digest_cache_path().parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_second_hasher_waits_for_the_first(tmp_path, monkeypatch, remember_at_once):
    """Two callers (a preload and its daemons) want the same files: one reads them, the other waits for its
    remembered digests."""
    path = write(tmp_path / "m.safetensors", random.Random(9).randbytes(2 * MIB16))
    go = threading.Event()
    readers = set()

    def first_caller_stalls(fd, bufs, off):
        readers.add(threading.current_thread().name)
        go.wait(20)

    reads = Reads(monkeypatch, first_caller_stalls)
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", file_digest(path)))
    first.start()
    while reads.n == 0:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: got.setdefault("second", file_digest(path)))
    second.start()
    time.sleep(0.3)
    n = reads.n
    go.set()
    first.join(20)
    second.join(20)
    assert got["first"] == got["second"] == ref_file(path.read_bytes())
    assert n <= 2 and reads.n == 2 * MIB16 // dg.READ  # read once, by the first caller's pool


# --- the background Future ------------------------------------------------------------------------------

def test_start_checkpoint_digest_gives_the_same_digest(tmp_path):
    write(tmp_path / "model.safetensors", random.Random(10).randbytes(MIB16 + 1))
    write(tmp_path / "config.json", b"{}")
    fut = dg.start_checkpoint_digest(tmp_path, threads=2, nice=5)
    assert fut.result(60) == checkpoint_digest(tmp_path) == ref_checkpoint(
        {"model.safetensors": (tmp_path / "model.safetensors").read_bytes(), "config.json": b"{}"})


def test_start_checkpoint_digest_can_be_cancelled(tmp_path, monkeypatch):
    write(tmp_path / "model.safetensors", random.Random(11).randbytes(4 * MIB16))
    started, go = threading.Event(), threading.Event()

    def stall(fd, bufs, off):
        started.set()
        go.wait(20)

    reads = Reads(monkeypatch, stall)
    fut = dg.start_checkpoint_digest(tmp_path, threads=2)
    assert started.wait(20)
    assert fut.cancel() and fut.cancelled()
    go.set()
    deadline = time.monotonic() + 20
    while any(t.name.startswith(("wc-hash", "wc-digest")) for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert reads.n <= 4  # stopped within one read per thread (the file has 64 reads)
    assert not dg.digest_cache_path().exists()


def test_start_checkpoint_digest_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no weight files"):
        dg.start_checkpoint_digest(tmp_path)
    write(tmp_path / "model.safetensors", b"q" * 5000)

    def denied(fd, bufs, off):
        raise PermissionError(13, "Permission denied")

    Reads(monkeypatch, denied)
    with pytest.raises(DigestError, match=r"cannot read .*model\.safetensors to hash it: Permission denied"):
        dg.start_checkpoint_digest(tmp_path).result(20)


def _hashers() -> list[int]:
    """Pids of this process's `python -m weightcache.digests` children."""
    import psutil

    return [c.pid for c in psutil.Process().children() if "weightcache.digests" in " ".join(c.cmdline())]


def test_a_hashing_process_gives_the_same_digest_and_remembers_it(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    write(model / "model.safetensors", random.Random(12).randbytes(2 * MIB16 + 3))
    write(model / "config.json", b"{}")
    old = time.time() - 3600  # not "just written": remembered
    for f in model.iterdir():
        os.utime(f, (old, old))
    time.sleep(1.1)  # the ctime must lie a second before the hash
    got = dg.start_checkpoint_digest(model, threads=2, in_a_process=True).result(60)
    assert got == ref_checkpoint({"model.safetensors": (model / "model.safetensors").read_bytes(), "config.json": b"{}"})
    assert dg.remembered_checkpoint_digest(model) == got, "the process stored the digests for this one"
    assert _hashers() == []


@contextlib.contextmanager
def hashing_held_back(folder):
    """Hold the folder's hashing lock, as another hasher would: a hashing process waits for it meanwhile."""
    import fcntl

    lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(lock)


def eventually(find, what: str, deadline: float):
    """find()'s first non-empty result before the deadline (time.monotonic())."""
    while not (found := find()):
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.02)
    return found


def all_gone(pids, what: str, deadline: float) -> None:
    while any(dg_alive(p) for p in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_hashing_process_reports_errors_as_digest_errors(tmp_path, monkeypatch, capsys):
    import signal

    write(tmp_path / "model.safetensors", b"q" * 5000)

    def denied(fd, bufs, off):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        Reads(m, denied)
        assert dg._main([str(tmp_path)]) == 1
    reply = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert reply == {"error": f"cannot read {tmp_path / 'model.safetensors'} to hash it: Permission denied",
                     "errno": 13}
    with hashing_held_back(tmp_path):  # the process is killed while it waits
        fut = dg.start_checkpoint_digest(tmp_path, in_a_process=True)
        os.kill(eventually(_hashers, "hashing process", time.monotonic() + 20)[0], signal.SIGKILL)
        with pytest.raises(DigestError, match="ended with exit status -9 and no digest"):
            fut.result(20)


def test_cancelling_a_hashing_process_ends_it(tmp_path):
    write(tmp_path / "model.safetensors", b"x")
    with hashing_held_back(tmp_path):
        fut = dg.start_checkpoint_digest(tmp_path, in_a_process=True)
        deadline = time.monotonic() + 20
        pids = eventually(_hashers, "hashing process", deadline)
        assert fut.cancel()
        all_gone(pids, "the hashing process outlived its cancellation", deadline)


def test_a_hashing_process_ends_with_the_process_that_started_it(tmp_path):
    import subprocess
    import sys

    import psutil

    write(tmp_path / "model.safetensors", b"x")
    with hashing_held_back(tmp_path):
        code = ("import sys, time; from weightcache import digests as dg; "
                f"dg.start_checkpoint_digest({str(tmp_path)!r}, in_a_process=True); time.sleep(60)")
        parent = subprocess.Popen([sys.executable, "-c", code])
        deadline = time.monotonic() + 30
        kids = eventually(lambda: [c.pid for c in psutil.Process(parent.pid).children()], "hashing process", deadline)
        parent.kill()
        parent.wait()
        all_gone(kids, "the hashing process outlived the preload that started it", deadline)


def dg_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- errors ---------------------------------------------------------------------------------------------

def test_missing_checkpoint_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weight files"):
        checkpoint_digest(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        checkpoint_digest(tmp_path / "nope")
    with pytest.raises(DigestError, match=r"cannot read .*gone\.safetensors to hash it: No such file"):
        file_digest(tmp_path / "gone.safetensors")


def test_unreadable_file_is_one_clear_error(tmp_path):
    (tmp_path / "a-dir.safetensors").mkdir()
    ok = write(tmp_path / "b.safetensors", b"fine" * 100)
    with pytest.raises(DigestError) as e:
        file_digests([ok, tmp_path / "a-dir.safetensors"], threads=2)
    assert str(e.value) == f"cannot read {tmp_path / 'a-dir.safetensors'} to hash it: not a regular file"
    assert isinstance(e.value, OSError)  # front ends catch OSError
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(DigestError, match="fifo.safetensors to hash it: not a regular file"):
        file_digests([tmp_path / "fifo.safetensors"])  # no hang on open


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_file_without_read_permission(tmp_path):
    path = write(tmp_path / "m.safetensors", b"secret")
    path.chmod(0)
    with pytest.raises(DigestError, match="to hash it: Permission denied"):
        file_digest(path)


def test_many_failing_files_give_the_first_ones_error(tmp_path, monkeypatch):
    paths = [write(tmp_path / f"m{i}.safetensors", b"v" * (MIB16 + i)) for i in range(4)]

    def denied(fd, bufs, off):
        raise PermissionError(13, "Permission denied")

    Reads(monkeypatch, denied)
    for _ in range(3):
        with pytest.raises(DigestError, match=r"m0\.safetensors to hash it"):
            file_digests(paths, threads=4)


def test_file_truncated_while_hashed(tmp_path, monkeypatch):
    path = write(tmp_path / "m.safetensors", random.Random(12).randbytes(3 * MIB16))

    def truncate_once(fd, bufs, off):
        if off == MIB16:
            os.truncate(path, MIB16 + 10)

    Reads(monkeypatch, truncate_once)
    with pytest.raises(DigestError, match="m.safetensors changed while it was being hashed"):
        file_digests([path], threads=1)
    assert not dg.digest_cache_path().exists()


def test_file_rewritten_while_hashed(tmp_path, monkeypatch):
    path = write(tmp_path / "m.safetensors", random.Random(13).randbytes(2 * MIB16))
    time.sleep(0.1)  # past the clock tick of its creation: the rewrite gets another ctime

    def rewrite_once(fd, bufs, off):
        if off == MIB16:
            with open(path, "r+b") as f:
                f.write(b"other bytes")

    Reads(monkeypatch, rewrite_once)
    with pytest.raises(DigestError, match="changed while it was being hashed"):
        file_digests([path], threads=1)


def test_safetensors_bytes_counts_a_local_checkpoints_safetensors_files(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 20)
    (tmp_path / "config.json").write_text("{}")
    assert safetensors_bytes(str(tmp_path)) == 30
    assert safetensors_bytes("org/some-hub-model") == 0
