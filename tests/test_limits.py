"""The daemon's limits under abuse: descriptor exhaustion, connection floods, idle and pinging clients, frame
headers that announce more than they send. It keeps serving the next good client through each."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time

import psutil
import pytest
import torch

import weightcache as wc
from procs import bits, sample_tensors, start_daemon
from weightcache import wire
from weightcache.key import CacheKey

KEY = CacheKey(model="sample", content_digest="d0")


def _sock(sockdir):
    return os.path.join(sockdir, "r0.sock")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5.0)
    s.connect(path)
    return s


def _serves_sample(path: str, wait: float = 10.0) -> None:
    expected = sample_tensors()
    with wc.attach(path, expect=KEY, wait=wait) as att:
        for name, t in expected.items():
            assert torch.equal(bits(att[name]), bits(t)), name


def _eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_connections_past_what_descriptors_allow_are_told_busy_at_once(sockdir, tmp_path):
    log_path = tmp_path / "daemon.stderr"
    err = open(log_path, "w")
    proc = start_daemon(_sock(sockdir), nofile=64, stderr=err, hello_timeout=60.0, max_per_peer=1000)
    idle = []
    try:
        for _ in range(80):  # more than it has descriptors for
            idle.append(_connect(_sock(sockdir)))
        told = 0
        for s in idle:  # each one past the cap got its answer at once, none waits in the backlog
            s.settimeout(0.05)
            try:
                frame = s.recv(4096)
            except TimeoutError:
                continue
            told += frame != b"" and isinstance(wire.decode(frame[4:]), wire.Error)
        assert told > 0
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) < 64, "it never ran out"
        with pytest.raises(wc.DaemonBusy):  # not a timeout
            wc.query_status(_sock(sockdir), timeout=5.0)
        for s in idle:
            s.close()
        idle.clear()
        _serves_sample(_sock(sockdir))
        assert wc.query_status(_sock(sockdir)).state == "ready"
        assert proc.poll() is None
        text = log_path.read_text()
        assert "descriptors are in use: at most" in text and "Traceback" not in text
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait()
        err.close()


SERVER_OUT_OF_DESCRIPTORS = r"""
import os, resource, sys
from weightcache import wire
from weightcache.server import UnixServer
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

def handler(conn, peer, status_only):
    wire.recv_msg(conn)
    wire.send_msg(conn, wire.Pong())

def refuse(conn, code, message):
    wire.send_msg(conn, wire.Error(code=code, message=message))
    conn.close()

server = UnixServer(sys.argv[1], handler, refuse)
server.bind()
server.start()
taken = []  # every descriptor left, as blocks and attaches might take them
while True:
    try:
        taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
print("FULL", flush=True)
sys.stdin.readline()
for fd in taken:
    os.close(fd)
print("FREED", flush=True)
sys.stdin.readline()
"""


def test_a_server_out_of_descriptors_says_busy_at_once(sockdir, tmp_path):
    """Out of descriptors (taken by something else than connections), the accept loop uses its spare one to
    tell each waiting client "busy" instead of leaving it in the backlog until its timeout."""
    err = open(tmp_path / "server.stderr", "w")
    proc = subprocess.Popen([os.sys.executable, "-c", SERVER_OUT_OF_DESCRIPTORS, _sock(sockdir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout.readline().strip() == "FULL"
        for _ in range(3):
            s = _connect(_sock(sockdir))
            s.settimeout(5.0)
            reply = wire.recv_msg(s)  # TimeoutError if it waits in the backlog
            assert isinstance(reply, wire.Error) and reply.code == "busy"
            assert "out of file descriptors" in reply.message
            s.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "FREED"
        deadline = time.monotonic() + 10
        while True:  # the spare is taken back, then clients are served again
            with _connect(_sock(sockdir)) as s:
                wire.send_msg(s, wire.Ping())
                reply = wire.recv_msg(s, deadline=time.monotonic() + 5)
            if isinstance(reply, wire.Pong):
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        err.close()
    assert "clients are told it is busy until it can" in (tmp_path / "server.stderr").read_text()


def test_accept_loop_outlives_a_thread_that_cannot_start(sockdir, monkeypatch):
    import weightcache.server as server_mod

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY):
        monkeypatch.setattr(server_mod.threading, "Thread", NoThread)
        with pytest.raises(wc.DaemonBusy, match="cannot start a thread for this connection"):
            wc.query_status(_sock(sockdir), timeout=5.0)
        monkeypatch.undo()
        assert wc.query_status(_sock(sockdir), timeout=5.0).state == "ready"
        with wc.attach(_sock(sockdir)) as att:
            assert att["w"].sum().item() == 3.0


def test_one_process_cannot_take_every_connection(sockdir):
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, max_per_peer=4, hello_timeout=30.0):
        idle = [_connect(_sock(sockdir)) for _ in range(4)]
        try:
            with pytest.raises(wc.DaemonBusy, match=f"process {os.getpid()} holds 4 connections"):
                wc.attach(_sock(sockdir))
            other = subprocess.run(  # another process still gets in
                [os.sys.executable, "-c", f"import weightcache; print(weightcache.attach({_sock(sockdir)!r})['w'].sum().item())"],
                capture_output=True, text=True, timeout=60)
            assert other.stdout.strip() == "3.0", other.stderr
            idle.pop().close()
            with wc.attach(_sock(sockdir), wait=5.0) as att:  # a slot of its own is free again
                assert att["w"].sum().item() == 3.0
        finally:
            for s in idle:
                s.close()


def _pinger(path: str, stop: threading.Event) -> socket.socket:
    s = _connect(path)

    def run():
        try:
            while not stop.is_set():
                wire.send_msg(s, wire.Ping())
                wire.recv_msg(s)
                time.sleep(0.05)
        except (OSError, EOFError, wc.WeightCacheError):
            pass

    threading.Thread(target=run, daemon=True).start()
    return s


def test_status_and_waiting_attach_get_through_a_flood_of_pingers(sockdir):
    stop = threading.Event()
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, max_clients=8, status_reserve=2,
                    idle_timeout=60.0) as daemon:
        flood = [_pinger(_sock(sockdir), stop) for _ in range(8)]
        try:
            assert _eventually(lambda: daemon.server.connections == 8)
            st = wc.query_status(_sock(sockdir))  # the reserve keeps status working
            assert st.state == "ready"
            with pytest.raises(wc.DaemonBusy, match="busy"):
                wc.attach(_sock(sockdir))  # wait=0: no retry
            with pytest.raises(wc.DaemonBusy):
                wc.attach(_sock(sockdir), wait=0.3)  # retried, but the flood stays

            def end_flood():
                stop.set()
                for s in flood:
                    s.close()

            threading.Timer(0.5, end_flood).start()
            with wc.attach(_sock(sockdir), wait=10.0) as att:  # retried until a slot frees
                assert att["w"].sum().item() == 3.0
        finally:
            stop.set()
            for s in flood:
                s.close()


def test_pings_do_not_keep_a_connection_open(sockdir):
    stop = threading.Event()
    with wc.publish({"w": torch.ones(3)}, _sock(sockdir), KEY, idle_timeout=0.5) as daemon:
        s = _pinger(_sock(sockdir), stop)
        try:
            assert _eventually(lambda: daemon.server.connections == 1)
            assert _eventually(lambda: daemon.server.connections == 0, timeout=5.0)  # dropped despite its pings
        finally:
            stop.set()
            s.close()
        with wc.attach(_sock(sockdir)) as att:
            assert att["w"].sum().item() == 3.0


def test_headers_announcing_large_frames_cost_the_daemon_nothing(sockdir):
    proc = start_daemon(_sock(sockdir), hello_timeout=30.0, max_per_peer=1000)
    conns = []
    try:
        daemon = psutil.Process(proc.pid)
        _serves_sample(_sock(sockdir))
        rss = daemon.memory_info().rss
        for n in (wire.MAX_FRAME, wire.MAX_REQUEST_FRAME):  # over the request cap, and at it
            for _ in range(24):
                s = _connect(_sock(sockdir))
                s.sendall(struct.pack(">I", n) + b"\x81" * 100)  # then nothing more, connection kept open
                conns.append(s)
        time.sleep(0.5)
        assert daemon.memory_info().rss - rss < 48 << 20
        refused = wire.decode(conns[0].recv(4096)[4:])
        assert isinstance(refused, wire.Error) and f"{wire.MAX_REQUEST_FRAME}-byte cap" in refused.message
        _serves_sample(_sock(sockdir))
    finally:
        for s in conns:
            s.close()
        proc.kill()
        proc.wait()


def test_frame_buffer_grows_with_what_arrived():
    import tracemalloc

    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", wire.MAX_FRAME) + b"x" * 1000)
    a.shutdown(socket.SHUT_WR)
    tracemalloc.start()
    try:
        with pytest.raises(wc.ProtocolError, match="closed inside a frame"):
            wire.recv_msg(b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        a.close()
        b.close()
    assert peak < 1 << 20, peak


HOST_BLOCK_UNDER_LIMIT = r"""
import resource, sys
from weightcache.arena.host import HostBlock
from weightcache.errors import ArenaOutOfMemory

def vm_size() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

try:
    if sys.argv[1] == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        HostBlock(1 << 20)
    elif sys.argv[1] == "as-init":
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (16 << 20),) * 2)
        HostBlock(64 << 20)
    else:  # as-seal: the fill fits, the read-only mapping that replaces the writable one does not
        block = HostBlock(64 << 20)
        block.tensor.fill_(7)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (32 << 20),) * 2)
        block.seal()
except ArenaOutOfMemory as e:
    print("OOM", e)
"""


@pytest.mark.parametrize("case, limit", [("fsize", "RLIMIT_FSIZE"), ("as-init", "RLIMIT_AS"), ("as-seal", "RLIMIT_AS")])
def test_host_block_past_a_resource_limit_is_out_of_memory(case, limit):
    proc = subprocess.run([os.sys.executable, "-c", HOST_BLOCK_UNDER_LIMIT, case], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.startswith("OOM cannot reserve"), proc.stdout + proc.stderr
    assert limit in proc.stdout and "Traceback" not in proc.stderr


def test_what_counts_as_out_of_memory():
    import errno

    from weightcache.errors import ArenaOutOfMemory
    from weightcache.preload.child import out_of_memory

    assert out_of_memory(ArenaOutOfMemory("x")) and out_of_memory(MemoryError())
    assert out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not out_of_memory(OSError(errno.ENOENT, "No such file or directory"))
    assert not out_of_memory(ValueError("bad config"))


def test_preload_past_rlimit_fsize_exits_3_in_one_line(tmp_path):
    """The documented exit code for out of memory, and the limit named, without a traceback."""
    import resource

    from safetensors.torch import save_file

    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": torch.ones(64, 1024)}, str(model / "model.safetensors"))  # 256 KiB, over the limit

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.run([os.sys.executable, "-m", "weightcache.cli", "preload", str(model), "--engine", "safetensors",
                           "--device", "cpu", "--weight-cache-socket-dir", str(tmp_path / "s"),
                           "--weight-cache-no-custodian"], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "exited with code 3: ArenaOutOfMemory: cannot reserve" in proc.stderr and "RLIMIT_FSIZE" in proc.stderr


PINGERS = r"""
import socket, sys, threading, time
from weightcache import wire

def ping_forever(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    try:
        s.connect(path)
        while True:
            wire.send_msg(s, wire.Ping())
            wire.recv_msg(s)
            time.sleep(0.05)
    except Exception:
        pass  # refused or dropped: this one is done

for _ in range(int(sys.argv[2])):
    threading.Thread(target=ping_forever, args=(sys.argv[1],), daemon=True).start()
print("PINGING", flush=True)
sys.stdin.read()
"""


def test_five_processes_of_pingers_leave_attach_an_answer_at_once(sockdir):
    """Five processes with 64 pinging connections each against a daemon with 256 descriptors: an attach with
    wait=0 gets in or is told "busy", never left waiting for its timeout."""
    proc = start_daemon(_sock(sockdir), nofile=256, max_per_peer=64)
    pingers = [subprocess.Popen([os.sys.executable, "-c", PINGERS, _sock(sockdir), "64"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(5)]
    try:
        for p in pingers:
            assert p.stdout.readline().strip() == "PINGING"
        time.sleep(1.0)
        for _ in range(3):
            try:
                with wc.attach(_sock(sockdir), expect=KEY, wait=0, timeout=5.0) as att:
                    assert att["embed"].shape[0] == 97
            except wc.DaemonBusy:
                pass  # DaemonUnavailable (no answer within the timeout) fails the test
    finally:
        for p in pingers:
            p.kill()
            p.wait()
        proc.kill()
        proc.wait()
