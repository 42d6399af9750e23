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


def test_accept_loop_survives_descriptor_exhaustion(sockdir, tmp_path):
    log_path = tmp_path / "daemon.stderr"
    err = open(log_path, "w")
    proc = start_daemon(_sock(sockdir), nofile=32, stderr=err, hello_timeout=60.0, max_per_peer=1000)
    idle = []
    try:
        for _ in range(40):  # more than it has descriptors for: the last ones wait in the listen backlog
            idle.append(_connect(_sock(sockdir)))
        assert _eventually(lambda: "out of file descriptors" in log_path.read_text())
        with pytest.raises(wc.DaemonUnavailable):  # no descriptor left for this one now
            wc.query_status(_sock(sockdir), timeout=0.5)
        for s in idle:
            s.close()
        idle.clear()
        _serves_sample(_sock(sockdir))  # it accepts again once descriptors free up
        assert wc.query_status(_sock(sockdir)).state == "ready"
        assert log_path.read_text().count("cannot accept connections") == 1  # once per episode
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait()
        err.close()


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
