"""Chaos, bounded to a few seconds: while engines attach, other processes exhaust the daemon's descriptors, flood
it with pinging and idle connections, send frame headers that announce 64 MiB and then trickle, and say Hello
one byte at a time; then the daemon is stopped (SIGSTOP) and killed (SIGKILL) under the engines. Every attach
that succeeds gets the right bytes, the daemon is alive and serving when the chaos ends, engines keep their
weights through its death, and its replacement serves the right bytes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import weightcache as wc
from procs import bits, sample_tensors, start_daemon
from weightcache import wire
from weightcache.key import CacheKey

KEY = CacheKey(model="sample", content_digest="d0")
CHAOS_SECONDS = 3.0

# Runs without torch (starts in milliseconds); frames come ready-made from the test.
CHAOS = r"""
import os, socket, sys, threading, time
path, seconds, ping, hello = sys.argv[1], float(sys.argv[2]), bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
end = time.monotonic() + seconds

def conn():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(0.5)
    s.connect(path)
    return s

def forever(fn):
    def run():
        while time.monotonic() < end:
            try:
                fn()
            except OSError:
                time.sleep(0.01)
    return run

def idle():  # holds a descriptor until the daemon drops it
    s = conn()
    try:
        s.settimeout(max(0.01, end - time.monotonic()))
        s.recv(1)
    finally:
        s.close()

def pinger():
    s = conn()
    try:
        while time.monotonic() < end:
            s.sendall(ping)
            if not s.recv(64):
                return
            time.sleep(0.02)
    finally:
        s.close()

def amplifier():  # announces 64 MiB, then trickles
    s = conn()
    try:
        s.sendall((64 << 20).to_bytes(4, "big"))
        while time.monotonic() < end:
            s.sendall(b"\x00" * 64)
            time.sleep(0.05)
    finally:
        s.close()

def slow_hello():
    s = conn()
    try:
        for i in range(len(hello)):
            s.sendall(hello[i:i + 1])
            time.sleep(0.1)
            if time.monotonic() > end:
                return
    finally:
        s.close()

kinds = [idle] * 12 + [pinger] * 4 + [amplifier] * 4 + [slow_hello] * 4
threads = [threading.Thread(target=forever(k), daemon=True) for k in kinds]
for t in threads:
    t.start()
for t in threads:
    t.join(seconds + 5)
"""


def _sock(sockdir):
    return os.path.join(sockdir, "r0.sock")


class Engines:
    """Threads that attach again and again, check every byte, and keep one attachment each."""

    def __init__(self, path: str, n: int = 3, **attach_kw):
        self.path, self.attach_kw = path, attach_kw
        self.expected = sample_tensors()
        self.ok = 0
        self.failures: list[str] = []
        self.wrong: list[str] = []
        self.kept: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                att = wc.attach(self.path, expect=KEY, **self.attach_kw)
            except wc.WeightCacheError as e:
                with self._lock:
                    self.failures.append(type(e).__name__)
                time.sleep(0.05)
                continue
            bad = [n for n, t in self.expected.items() if not torch.equal(bits(att[n]), bits(t))]
            with self._lock:
                self.ok += 1
                self.wrong += bad
                if len(self.kept) < 3:
                    self.kept.append(att)
                    continue
            att.close()

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _still_right(att, expected) -> bool:
    return all(torch.equal(bits(att[n]), bits(t)) for n, t in expected.items())


def test_chaos_then_the_daemon_or_its_replacement_serves_the_right_bytes(sockdir, tmp_path):
    path = _sock(sockdir)
    log = open(tmp_path / "daemon.stderr", "w")
    proc = start_daemon(path, nofile=48, hello_timeout=1.0, idle_timeout=2.0, max_clients=48, max_per_peer=24,
                        status_reserve=4, stderr=log)
    replacement = None
    ping = wire.encode(wire.Ping()).hex()
    hello = wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, expect=KEY)).hex()
    chaos = [subprocess.Popen([sys.executable, "-c", CHAOS, path, str(CHAOS_SECONDS), ping, hello])
             for _ in range(3)]
    try:
        engines = Engines(path, wait=5.0, timeout=2.0)
        for c in chaos:
            assert c.wait(CHAOS_SECONDS + 30) == 0
        engines.stop()
        assert not engines.wrong, engines.wrong
        assert engines.ok > 0, f"no engine got through the chaos: {engines.failures[-5:]}"
        assert proc.poll() is None, "the daemon survived the chaos"
        # its descriptor limit caps the connections, so the chaos is told "busy" rather than exhausting them
        assert "descriptors are in use: at most" in (tmp_path / "daemon.stderr").read_text()
        with wc.attach(path, expect=KEY, wait=10.0) as att:  # and serves once it is over
            assert _still_right(att, engines.expected)
        assert wc.query_status(path).state == "ready"

        # SIGSTOP while engines attach: they time out, and the daemon serves again after SIGCONT
        proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(wc.DaemonUnavailable):
                wc.attach(path, expect=KEY, timeout=0.5)
        finally:
            proc.send_signal(signal.SIGCONT)
        with wc.attach(path, expect=KEY, wait=10.0) as att:
            assert _still_right(att, engines.expected)

        # SIGKILL while engines attach: what they hold stays right; a replacement serves the right bytes
        engines = Engines(path, wait=0.0, timeout=1.0)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        time.sleep(0.3)
        engines.stop()
        assert not engines.wrong, engines.wrong
        assert engines.kept, "the engines attached before the kill"
        for att in engines.kept:
            assert _still_right(att, engines.expected)
        with pytest.raises(wc.DaemonUnavailable, match="stale"):
            wc.attach(path, expect=KEY)
        replacement = start_daemon(path)
        with wc.attach(path, expect=KEY) as att:
            assert _still_right(att, engines.expected)
        for att in engines.kept:
            att.close()
    finally:
        for c in chaos:
            c.kill()
            c.wait()
        for p in (proc, replacement):
            if p is not None:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        log.close()


# ------------------------------------------------------------------------------------------- the custodian

def _stalled_claim(sockdir, name: str, token: str):
    """A client that claims a cache and never reads the answer."""
    from weightcache.custodian.messages import Claim, Hello
    from weightcache.custodian.messages import _decoder as custodian_decoder
    from weightcache.sockets import custodian_socket_path

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(custodian_socket_path(sockdir)))
    wire.send_msg(s, Hello(protocol=2))
    wire.recv_msg(s, deadline=time.monotonic() + 5, decoder=custodian_decoder)
    wire.send_msg(s, Claim(name=name, token=token))
    return s


def test_custodian_chaos_a_blocked_client_sigstop_sigkill_and_a_poisoned_deposit(sockdir, tmp_path, capsys):
    """While engines attach: a claimer stops reading (everyone else is served; it is dropped), the custodian
    is stopped (reported as such, never as holding nothing; a new preload refuses to start) and killed (the
    preload starts a new one and the daemon deposits its cache with it again), and a process outside the
    preload deposits a poisoned block under the cache's name (refused). A replacement daemon then serves the
    right bytes without a load."""
    import json

    import msgspec

    from procs import block_digests, start_held_daemon
    from test_custodian import NAME, one_block, sealed_memfd, wait_for
    from test_custodian_trust import OUTSIDER, _manifest_for
    from weightcache.cli import main
    from weightcache.custodian.client import CustodianClient
    from weightcache.custodian.messages import CustodianUnresponsive
    from weightcache.handover import use_credential
    from weightcache.preload.custody import Custody
    from weightcache.sockets import custodian_socket_path

    path = os.path.join(sockdir, NAME)
    custody = Custody(sockdir)  # the supervisor's side, in this process: daemons we start are its own
    custody.open()
    use_credential(custodian_socket_path(sockdir), custody.token)
    daemons = []
    engines = None
    try:
        daemon, how = start_held_daemon(path, custody.socket, token=custody.token)
        daemons.append(daemon)
        assert how == "LOADED"
        served = block_digests(path)
        engines = Engines(path, wait=5.0, timeout=2.0)
        first = custody.client.pid

        # a blocked client: a claimer of a 4 MiB answer that never reads it
        big = KEY.replace(rank=1, extra={"pad": "x" * (4 << 20)})
        h, k, m = one_block(torch.arange(8, dtype=torch.int32), big)
        fd = sealed_memfd()
        custody.client.deposit(h, k, m, [fd], custody.token)
        os.close(fd)
        stalled = _stalled_claim(sockdir, h.name, custody.token)
        t0 = time.monotonic()
        assert main(["release", "--list", "--socket-dir", sockdir, "--timeout", "2"]) == 0
        assert NAME in capsys.readouterr().out
        assert custody.client.release([h.name]).names == [h.name]
        wait_for(lambda: "stopped reading" in (Path(sockdir) / "custodian.log").read_text(), 10, "the drop")
        assert time.monotonic() - t0 < 10
        stalled.close()

        # SIGSTOP: reported as stopped by release, status, the watch and a new preload; fine after SIGCONT
        os.kill(first, signal.SIGSTOP)
        try:
            assert main(["release", "--list", "--socket-dir", sockdir, "--timeout", "1"]) == 1
            assert "is stopped and does not answer" in capsys.readouterr().err
            assert main(["status", "--socket-dir", sockdir, "--timeout", "1"]) == 1
            assert "is stopped and does not answer" in capsys.readouterr().err
            wait_for(lambda: custody.info()["state"] == "unresponsive", 10, "the watch to notice")
            second = Custody(sockdir)
            second.connect_timeout = 1.0
            with pytest.raises(CustodianUnresponsive):
                second.open()
        finally:
            os.kill(first, signal.SIGCONT)
        wait_for(lambda: custody.info()["state"] == "up", 10, "the custodian to answer again")

        # SIGKILL: the preload's side starts a new one; the running daemon deposits its cache again
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: custody.info().get("pid") not in (None, first) and custody.info()["up"], 15,
                 "a new custodian")
        assert custody.restarts == 1
        fresh = CustodianClient.connect(sockdir)
        wait_for(lambda: [x.name for x in fresh.holdings().holdings] == [NAME], 15, "the daemon to deposit again")

        # a poisoned deposit from a process outside the preload, then the daemon dies
        (held,) = fresh.holdings().holdings
        facts = tmp_path / "facts.json"
        facts.write_text(json.dumps({"name": NAME, "token": custody.token, "blocks": held.block_bytes,
                                     "key": msgspec.msgpack.encode(KEY).hex(),
                                     "manifest": _manifest_for(held.block_bytes).hex()}))
        said = tmp_path / "said.json"
        subprocess.run([sys.executable, "-c", OUTSIDER, sockdir, str(facts), str(said)], check=True, timeout=60)
        wait_for(said.exists, 30, "the outsider")
        assert "HELD" not in said.read_text() and "GOT IT" not in said.read_text()
        daemon.kill()
        daemon.wait()
        wait_for(lambda: not fresh.holdings().holdings[0].served_by, 10, "the custodian to see the death")
        daemon, how = start_held_daemon(path, custody.socket, token=custody.token)
        daemons.append(daemon)
        assert how == "ADOPTED" and block_digests(path) == served
        time.sleep(0.5)
        engines.stop()
        assert not engines.wrong, engines.wrong
        assert engines.ok > 0 and engines.kept
        for att in engines.kept:
            assert _still_right(att, engines.expected)
            att.close()
        fresh.close()
    finally:
        if engines is not None:
            engines.stop()
        for d in daemons:
            d.kill()
            d.wait()
        custody.finish(keep=False)
