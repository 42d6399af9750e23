"""Publish -> attach round trips, read-only mappings, either side dying, leaks, concurrency."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import weightcache as wc
from conftest import DEVICES
from procs import bits, sample_tensors, start_daemon
from weightcache.key import CacheKey
from weightcache.sources import FillSource

KEY = CacheKey(model="sample", content_digest="d0")


def _sock(sockdir):
    return os.path.join(sockdir, "r0.sock")


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_every_dtype_bit_identical(sockdir, device):
    src = sample_tensors(device)
    with wc.publish(src, _sock(sockdir), KEY):
        with wc.attach(_sock(sockdir), expect=KEY) as att:
            assert set(att) == set(src)
            for name, t in src.items():
                v = att[name]
                assert v.device.type == torch.device(device).type
                assert (v.dtype, v.shape, v.stride()) == (t.dtype, t.shape, t.stride()), name
                assert torch.equal(bits(v), bits(t)), name
            assert att["embed"].data_ptr() == att["lm_head"].data_ptr()  # tied stays tied
            assert att["slice_a"].untyped_storage().data_ptr() == att["slice_b"].untyped_storage().data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_copy_mode_is_private_and_writable(sockdir, device):
    src = sample_tensors(device)
    with wc.publish(src, _sock(sockdir), KEY):
        with wc.attach(_sock(sockdir), mode="copy") as mine, wc.attach(_sock(sockdir)) as shared:
            mine["embed"].add_(1.0)
            assert torch.equal(mine["embed"], mine["lm_head"])  # ties survive the copy
            assert torch.equal(bits(shared["embed"]), bits(src["embed"]))


def test_writable_map_on_cpu_is_private_copy_on_write(sockdir):
    """The blocks are sealed: readonly=False maps them privately, so an engine's writes stay its own."""
    with wc.publish({"w": torch.zeros(4)}, _sock(sockdir), KEY):
        a = wc.attach(_sock(sockdir), readonly=False)
        b = wc.attach(_sock(sockdir))
        a["w"][0] = 7.0
        assert a["w"][0].item() == 7.0
        assert b["w"][0].item() == 0.0
        with wc.attach(_sock(sockdir)) as c:
            assert c["w"].sum().item() == 0.0
        a.close()
        b.close()


def _raw_attach(path: str) -> list[int]:
    """The block fds a daemon hands out, received by hand (what an engine holds before it maps them)."""
    import socket

    from weightcache import wire

    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    wire.send_msg(s, wire.Hello(protocol=wire.PROTOCOL_VERSION, readonly=False))
    reply = wire.recv_msg(s)
    fds = wire.recv_fds(s, reply.nfds)
    s.close()
    return fds


def test_cpu_blocks_are_sealed_even_against_reopening_the_memfd(sockdir):
    import errno
    import fcntl
    import mmap

    src = sample_tensors()
    with wc.publish(src, _sock(sockdir), KEY) as daemon:
        for fd in _raw_attach(_sock(sockdir)):
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_WRITE, seals  # no writable mapping was left in the daemon either
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the kernel lets us reopen it read-write...
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\xff" * 8, 0)  # ...but not write
            with pytest.raises(PermissionError):
                mmap.mmap(rw, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError) as e:
                os.ftruncate(rw, 0)
            assert e.value.errno == errno.EPERM
            os.close(rw)
            os.close(fd)
        # the daemon keeps no writable mapping of its own: every shared mapping of a block is read-only
        maps = [line.split()[1] for line in open("/proc/self/maps") if "memfd:weightcache" in line]
        shared = [perms for perms in maps if perms[3] == "s"]
        assert shared and all(perms[1] == "-" for perms in shared), maps
        assert daemon.state == "ready"
        with wc.attach(_sock(sockdir)) as att:
            for name, t in src.items():
                assert torch.equal(bits(att[name]), bits(t)), name


WRITER = """
import sys, torch, weightcache
att = weightcache.attach({sock!r})
t = att["embed"]
print("ATTACHED", flush=True)
t.add_(1.0)
if t.is_cuda:
    torch.cuda.synchronize()
print("WROTE", flush=True)
"""


@pytest.mark.parametrize("device", DEVICES)
def test_write_through_readonly_mapping_faults_and_daemon_bytes_survive(sockdir, device):
    src = sample_tensors(device)
    with wc.publish(src, _sock(sockdir), KEY) as daemon:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # the line comes first, faulthandler's traceback next
        proc = subprocess.run(
            [sys.executable, "-c", WRITER.format(sock=_sock(sockdir))], capture_output=True, text=True, timeout=120,
            env=env,
        )
        assert "ATTACHED" in proc.stdout
        assert "WROTE" not in proc.stdout
        assert proc.returncode != 0
        if device == "cpu":
            assert proc.returncode == -signal.SIGSEGV
            # one line names the tensor and its mapping before the process dies
            line = next(x for x in proc.stderr.splitlines() if x.startswith("weightcache: write to read-only"))
            assert "tensor 'embed'" in line and "'lm_head'" in line and "block 0 of " + _sock(sockdir) in line
            assert "Fatal Python error: Segmentation fault" in proc.stderr.split(line)[1]
        else:
            assert "illegal" in proc.stderr.lower() or "error" in proc.stderr.lower()
        assert daemon.state == "ready"
        with wc.attach(_sock(sockdir)) as att:
            assert torch.equal(bits(att["embed"]), bits(src["embed"]))


SEGV_SENT = """
import os, signal, time, weightcache
att = weightcache.attach({sock!r})
print("ATTACHED", flush=True)
os.kill(os.getpid(), signal.SIGSEGV)
time.sleep(5)
print("SURVIVED", flush=True)
"""


def test_a_sigsegv_sent_to_an_engine_still_kills_it(sockdir):
    """The write-fault handler only names faults; a SIGSEGV sent with kill() ends the process as before."""
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY):
        proc = subprocess.run([sys.executable, "-c", SEGV_SENT.format(sock=_sock(sockdir))], capture_output=True,
                              text=True, timeout=120)
    assert "ATTACHED" in proc.stdout and "SURVIVED" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV and "weightcache:" not in proc.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_engine_keeps_computing_after_daemon_sigkill(sockdir, device):
    proc = start_daemon(_sock(sockdir), device)
    try:
        att = wc.attach(_sock(sockdir), expect=KEY)
        expected = sample_tensors(device)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        x = torch.randn(5, 33, device=att["embed"].device)
        got = x @ att["embed"].float().t() + att["w_t"].float().sum()
        want = x @ expected["embed"].float().t() + expected["w_t"].float().sum()
        assert torch.allclose(got, want)
        assert torch.equal(bits(att["fp8_e4m3"]), bits(expected["fp8_e4m3"]))
        att.close()
    finally:
        proc.kill()
    # the killed daemon left its socket behind: attach says so clearly, a new daemon replaces it
    with pytest.raises(wc.DaemonUnavailable, match="stale"):
        wc.attach(_sock(sockdir))
    with wc.publish({"x": torch.ones(2)}, _sock(sockdir), KEY):
        assert wc.query_status(_sock(sockdir)).state == "ready"


ENGINE_DIES = """
import os, weightcache
att = weightcache.attach({sock!r})
assert att["embed"].sum() == att["embed"].sum()
os._exit(9)
"""


def test_engine_dies_daemon_serves_next(sockdir):
    src = sample_tensors()
    with wc.publish(src, _sock(sockdir), KEY) as daemon:
        for _ in range(3):
            rc = subprocess.run([sys.executable, "-c", ENGINE_DIES.format(sock=_sock(sockdir))], timeout=60).returncode
            assert rc == 9
        with wc.attach(_sock(sockdir)) as att:
            assert torch.equal(att["embed"], src["embed"])
        st = daemon.status()
        assert st.attaches_served == 4


def _eventually(check, timeout: float = 10.0) -> bool:
    """The daemon learns of a detach when it reads the closed connection: poll for it."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("device", DEVICES)
def test_thousand_attach_close_cycles_leak_nothing(sockdir, device):
    proc = start_daemon(_sock(sockdir), device, scale=50)  # a few MB, so a leak would show in RSS
    try:
        me = psutil.Process()

        def cycle(n):
            for _ in range(n):
                att = wc.attach(_sock(sockdir))
                s = att["embed"][0, 0].item()
                att.close()
                del att
            return s

        cycle(50)
        fds, rss = _open_fds(), me.memory_info().rss
        gpu = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
        cycle(1000)
        assert _open_fds() <= fds
        assert me.memory_info().rss - rss < 32 << 20
        if device == "cuda":
            assert abs(torch.cuda.mem_get_info()[0] - gpu) < 64 << 20
        assert wc.query_status(_sock(sockdir)).attaches_served == 1050
        assert _eventually(lambda: wc.query_status(_sock(sockdir)).clients_attached == 0)
    finally:
        proc.kill()
        proc.wait()


def test_many_concurrent_clients_get_correct_weights(sockdir):
    src = sample_tensors()
    errors = []
    with wc.publish(src, _sock(sockdir), KEY) as daemon:
        def engine():
            try:
                with wc.attach(_sock(sockdir), expect=KEY) as att:
                    for name, t in src.items():
                        assert torch.equal(bits(att[name]), bits(t))
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=engine) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert daemon.status().attaches_served == 32


def test_silent_client_does_not_stall_others(sockdir):
    import socket

    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, hello_timeout=30.0):
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(_sock(sockdir))  # connects and says nothing
        with wc.attach(_sock(sockdir), timeout=5.0) as att:
            assert att["w"].sum().item() == 3.0
        silent.close()


def test_silent_client_is_dropped_after_its_deadline(sockdir):
    import socket

    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, hello_timeout=0.3):
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(_sock(sockdir))
        silent.settimeout(5.0)
        data = silent.recv(4096)  # an error frame, then EOF
        assert b"protocol" in data
        silent.close()


def test_wrong_key_lists_every_differing_field(sockdir):
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY) as daemon:
        wrong = KEY.replace(dtype="bfloat16", layout="dp1-pp1-tp2", content_digest="other")
        with pytest.raises(wc.KeyMismatch) as err:
            wc.attach(_sock(sockdir), expect=wrong)
        fields = {d.field for d in err.value.diffs}
        assert fields == {"dtype", "layout", "content_digest"}
        for f in fields:
            assert f in str(err.value)
        assert daemon.status().attaches_refused == 1
        with wc.attach(_sock(sockdir), expect=KEY) as att:  # still serving
            assert att["w"].sum().item() == 3.0


def _attach_as(uid: int, sock: str) -> str:
    """Attach from a forked child running as another uid; returns what it saw."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no exec, the modules are already imported
        os.close(r)
        try:
            os.setuid(uid)
            wc.attach(sock)
            out = "ATTACHED"
        except wc.PermissionDenied as e:
            out = f"DENIED {e}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"OTHER {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch uid")
def test_peer_with_another_uid_is_refused(sockdir):
    os.chmod(sockdir, 0o755)
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, allowed_uids=[4242]) as daemon:
        out = _attach_as(65534, _sock(sockdir))
        assert out.startswith("DENIED") and "65534" in out, out
        assert daemon.status().attaches_refused == 1
        assert _attach_as(4242, _sock(sockdir)) == "ATTACHED"
        with wc.attach(_sock(sockdir)) as att:
            assert att["w"].sum().item() == 3.0


def test_default_socket_is_owner_only(sockdir):
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY):
        assert os.stat(_sock(sockdir)).st_mode & 0o777 == 0o600


def test_live_socket_is_never_stolen(sockdir):
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY):
        with pytest.raises(wc.SocketInUse):
            wc.publish({"w": torch.zeros(3)}, _sock(sockdir), KEY)
        with wc.attach(_sock(sockdir)) as att:
            assert att["w"].sum().item() == 3.0


def test_non_socket_file_is_not_replaced(sockdir):
    path = _sock(sockdir)
    with open(path, "w") as f:
        f.write("precious")
    with pytest.raises(wc.SocketInUse, match="not a socket"):
        wc.publish({"w": torch.ones(3)}, path, KEY)
    assert open(path).read() == "precious"


def test_group_writable_socket_dir_is_refused(sockdir):
    os.chmod(sockdir, 0o777)
    with pytest.raises(wc.WeightCacheError, match="writable by others"):
        wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY)


def test_missing_daemon_is_a_clear_error(sockdir):
    with pytest.raises(wc.DaemonUnavailable, match="no such socket"):
        wc.attach(_sock(sockdir))


class SlowSource(FillSource):
    def __init__(self):
        self.let_go = threading.Event()
        self.halfway = threading.Event()

    def describe(self):
        from weightcache.manifest import TensorMeta

        return [TensorMeta("w", "float32", [1024])]

    def fill(self, views, progress):
        views["w"][:512] = 1.0
        progress(2048)
        self.halfway.set()
        self.let_go.wait(30)
        views["w"][512:] = 2.0
        progress(2048)

    def key_fields(self):
        return {}


def test_attach_waits_while_loading_then_gets_weights(sockdir):
    daemon = wc.Daemon(_sock(sockdir), KEY)
    daemon.start()
    src = SlowSource()
    loader = threading.Thread(target=daemon.load, args=(src,))
    loader.start()
    try:
        with pytest.raises(wc.DaemonNotReady, match="loading"):
            wc.attach(_sock(sockdir), wait=0.0)
        assert src.halfway.wait(10)
        st = wc.query_status(_sock(sockdir))
        assert st.state == "loading" and st.done == 2048 and st.total == 4096
        assert st.load_bytes_per_second > 0
        from weightcache.status_table import collect

        assert [r["state"] for r in collect(sockdir)] == [
            f"loading 50% {wc.query_status(_sock(sockdir)).load_bytes_per_second / 1e9:.2f} GB/s"]
        threading.Timer(0.3, src.let_go.set).start()
        with wc.attach(_sock(sockdir), wait=10.0) as att:
            assert att["w"].sum().item() == 512 * 1.0 + 512 * 2.0
        st = daemon.status()
        assert st.load_bytes_per_second == pytest.approx(4096 / st.load_seconds)
    finally:
        src.let_go.set()
        loader.join()
        daemon.close()


class BrokenSource(SlowSource):
    def fill(self, views, progress):
        raise FileNotFoundError("model-00002-of-00002.safetensors")


def test_failed_load_is_reported_to_engines(sockdir):
    daemon = wc.Daemon(_sock(sockdir), KEY)
    daemon.start()
    with pytest.raises(FileNotFoundError):
        daemon.load(BrokenSource())
    try:
        assert wc.query_status(_sock(sockdir)).state == "failed"
        with pytest.raises(wc.DaemonNotReady, match="model-00002"):
            wc.attach(_sock(sockdir), wait=5.0)
    finally:
        daemon.close()
    assert not os.path.exists(_sock(sockdir))


class PreparedBrokenSource(BrokenSource):
    """A source that stages (prepare) and fails: what it prepared must go."""

    prepared = released = 0

    def prepare(self):
        self.prepared += 1

    def release(self):
        self.released += 1


def test_failed_load_releases_what_the_source_prepared(sockdir):
    daemon = wc.Daemon(_sock(sockdir), KEY)
    daemon.start()
    src = PreparedBrokenSource()
    try:
        with pytest.raises(FileNotFoundError):
            daemon.load(src)
    finally:
        daemon.close()
    assert (src.prepared, src.released) == (1, 1)


def test_host_arena_out_of_memory_is_clear():
    from weightcache.arena.host import HostBlock

    with pytest.raises(wc.ArenaOutOfMemory, match="GiB"):
        HostBlock(1 << 50)


@pytest.mark.gpu
def test_gpu_out_of_memory_is_clear():
    from weightcache.arena.cuda import CudaBlock

    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(wc.ArenaOutOfMemory, match="GiB free"):
        CudaBlock(free + (64 << 30), 0)


@pytest.mark.gpu
def test_gpu_attach_adds_no_device_memory(sockdir):
    proc = start_daemon(_sock(sockdir), "cuda", scale=20000)  # ~250 MB
    try:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        before = torch.cuda.mem_get_info()[0]
        att = wc.attach(_sock(sockdir))
        after = torch.cuda.mem_get_info()[0]
        assert att.nbytes > 200 << 20
        assert before - after < 8 << 20
        att.close()
    finally:
        proc.kill()
        proc.wait()


def test_status_counts_clients(sockdir):
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY):
        a = wc.attach(_sock(sockdir))
        b = wc.attach(_sock(sockdir))
        st = wc.query_status(_sock(sockdir))
        assert st.clients_attached == 2 and st.attaches_served == 2 and st.bytes_served == 2 * a.nbytes
        a.close()
        b.close()
        assert _eventually(lambda: wc.query_status(_sock(sockdir)).clients_attached == 0)


def test_daemon_sigterm_removes_socket(sockdir):
    proc = start_daemon(_sock(sockdir))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not os.path.exists(_sock(sockdir))


def test_watch_forgets_from_a_finalizer_while_it_holds_its_lock():
    """A GC pass inside the watch's add() (creating its thread) can run an earlier Attachment's finalizer on
    the same thread, which forgets that attachment's connection: it must not wait for the lock it holds."""
    import socket

    from weightcache.client import _Watch

    watch = _Watch()
    a, b = socket.socketpair()
    lost = []
    try:
        watch.add(a, lambda: lost.append(a))

        def finalizer_inside_add():
            with watch._lock:
                watch.forget_and_close(a)

        t = threading.Thread(target=finalizer_inside_add, daemon=True)
        t.start()
        t.join(timeout=5)
        assert not t.is_alive(), "forget() deadlocked on the watch's own lock"
        assert a.fileno() == -1 and not watch._sel.get_map() and lost == []
    finally:
        a.close()
        b.close()


def test_watch_thread_starting_may_forget_while_add_returns(monkeypatch):
    """The watch's new thread can run a finalizer (a GC pass) before its start() returns, and that finalizer
    forgets an earlier connection: add() must not hold the lock while it waits for the thread to start."""
    import socket

    from weightcache import client
    from weightcache.client import _Watch

    watch = _Watch()
    first, first_peer = socket.socketpair()
    second, second_peer = socket.socketpair()
    forgot = threading.Event()
    real_thread = threading.Thread

    class ThreadThatForgetsFirst(real_thread):
        def start(self):
            real_thread(target=lambda: (watch.forget(first), forgot.set()), daemon=True).start()
            assert forgot.wait(5), "add() held the watch's lock while its thread started"
            super().start()

    try:
        watch._sel.register(first, client.selectors.EVENT_READ, None)
        monkeypatch.setattr(client.threading, "Thread", ThreadThatForgetsFirst)
        watch.add(second, lambda: None)
        assert forgot.is_set() and list(watch._sel.get_map().values())[0].fileobj is second
    finally:
        watch.forget(second)
        for s in (first, first_peer, second, second_peer):
            s.close()


def test_a_daemon_named_after_its_load_serves_and_one_closed_first_binds_nothing(sockdir):
    """A daemon may load before its key is known (the checkpoint's digest is still being made); it serves once
    named. One that is closed before it is named never binds its socket."""
    from weightcache.daemon import Daemon

    d = Daemon(None, None)
    done = threading.Thread(target=d.load_tensors, args=(sample_tensors(),))
    done.start()
    time.sleep(0.3)
    assert done.is_alive() and d.state == "starting", "the load waits for the key before it seals"
    d.name(_sock(sockdir), KEY, start=True)
    done.join(30)
    try:
        assert d.state == "ready" and d.status().phases["key wait"] >= 0.2
        with wc.attach(_sock(sockdir), expect=KEY) as att:
            assert set(att.tensors) == set(sample_tensors())
    finally:
        d.close()

    late = Daemon(None, None)
    late.close()
    path = os.path.join(sockdir, "late.sock")
    with pytest.raises(RuntimeError, match="closed before its cache key was known"):
        late.name(path, KEY, start=True)
    assert not os.path.exists(path)
