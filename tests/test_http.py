"""The HTTP app over daemon entries, and over a real uvicorn server on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families

from weightcache.key import CacheKey
from weightcache.preload.http import DaemonEntry, HealthServer, build_app, healthy, render_metrics
from weightcache.wire import ATTACH_BUCKETS, DaemonStatus


def status(rank: int, state: str = "ready", **kw) -> DaemonStatus:
    key = CacheKey(model="tiny-llama", content_digest="sha256:aa", rank=rank, layout="dp1-pp1-tp2")
    fields = dict(state=state, key=key, device="cpu", pid=100 + rank, started_at=1000.0, nbytes=4096,
                  ntensors=12, nblocks=1, clients_attached=2, attaches_served=5, bytes_served=20480,
                  load_seconds=0.25, load_bytes_per_second=16384.0, attach_seconds_sum=0.004, attach_seconds_count=5,
                  attach_seconds_buckets=[0, 3, 4] + [5] * (len(ATTACH_BUCKETS) - 3))
    fields.update(kw)
    return DaemonStatus(**fields)


def entries(*states):
    return [DaemonEntry("main", r, f"/tmp/x/main-r{r}.sock", device="cpu", pid=100 + r, status=status(r, s))
            for r, s in enumerate(states)]


def test_health_follows_every_daemon():
    current = entries("ready", "loading")
    client = TestClient(build_app(lambda: current))
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["not_ready"] == ["main rank 1: loading"]
    current[:] = entries("ready", "ready")
    assert client.get("/health").status_code == 200
    current[1].alive, current[1].status, current[1].exitcode = False, None, -9
    current[1].error = "process exited with code -9"
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["not_ready"] == ["main rank 1: exited (process exited with code -9)"]
    current[:] = []
    assert client.get("/health").status_code == 503, "no daemons is not healthy"


def test_unreachable_daemon_is_unhealthy():
    e = DaemonEntry("draft", 0, "/tmp/x/draft-r0.sock", error="no daemon at /tmp/x/draft-r0.sock")
    assert e.state == "unreachable" and not healthy([e])


def test_metrics_are_prometheus_text():
    current = entries("ready", "ready")
    current.append(DaemonEntry("draft", 0, "/tmp/x/d.sock", device="cpu", error="refused"))
    r = TestClient(build_app(lambda: current)).get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    by = {(s.name, s.labels.get("role"), s.labels.get("rank"), s.labels.get("le")): s.value
          for f in fams.values() for s in f.samples}
    assert by[("weightcache_bytes", "main", "1", None)] == 4096
    assert by[("weightcache_tensors", "main", "0", None)] == 12
    assert by[("weightcache_clients_attached", "main", "0", None)] == 2
    assert by[("weightcache_attaches_total", "main", "1", None)] == 5
    assert by[("weightcache_load_duration_seconds", "main", "0", None)] == 0.25
    assert by[("weightcache_load_bytes_per_second", "main", "0", None)] == 16384.0
    assert by[("weightcache_daemon_up", "draft", "0", None)] == 0
    assert by[("weightcache_daemon_ready", "main", "0", None)] == 1
    assert by[("weightcache_attach_seconds_bucket", "main", "0", "0.001")] == 3
    assert by[("weightcache_attach_seconds_bucket", "main", "0", "+Inf")] == 5
    assert by[("weightcache_attach_seconds_count", "main", "0", None)] == 5
    assert by[("weightcache_attach_seconds_sum", "main", "0", None)] == pytest.approx(0.004)
    sample = next(s for s in fams["weightcache_bytes"].samples if s.labels["rank"] == "0")
    assert sample.labels == {"role": "main", "rank": "0", "device": "cpu", "model": "tiny-llama"}
    assert ("weightcache_bytes", "draft", "0", None) not in by


def test_status_json():
    current = entries("ready")
    body = TestClient(build_app(lambda: current, info=lambda: {"node_rank": 0})).get("/status").json()
    assert body["healthy"] is True and body["node_rank"] == 0
    d = body["daemons"][0]
    assert d["role"] == "main" and d["state"] == "ready"
    assert d["status"]["key"]["model"] == "tiny-llama" and d["status"]["nbytes"] == 4096


def test_render_metrics_with_no_daemons():
    assert b"weightcache_daemon_up" in render_metrics([])


def test_real_server_on_loopback_and_busy_port():
    current = entries("loading")
    server = HealthServer(build_app(lambda: current), "127.0.0.1", 0)
    port = server.start()
    try:
        assert port > 0
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 503
        current[:] = entries("ready")
        assert httpx.get(url + "/health").status_code == 200
        busy = HealthServer(build_app(lambda: current), "127.0.0.1", port)
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            busy.start()
    finally:
        server.stop()
    t0 = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert time.monotonic() - t0 < 2


# --- slow and idle clients (the guard in front of uvicorn) ---

def _get(port: int, path: str = "/health", timeout: float = 3.0) -> bytes:
    """One request on a raw socket (no client library cost in the timing); the whole response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def _partial(port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head's blank line never comes
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture
def ready_server():
    servers = []

    def start(**kw):
        server = HealthServer(build_app(lambda: entries("ready")), "127.0.0.1", 0, **kw)
        servers.append(server)
        return server, server.start()

    yield start
    for s in servers:
        s.stop()


def test_a_request_head_that_never_completes_is_closed(ready_server):
    server, port = ready_server(head_timeout=0.3)
    slow, silent = _partial(port), socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        assert _closed_within(slow, 5.0) and _closed_within(silent, 5.0)
        assert server.guard.timed_out == 2
        assert _get(port).startswith(b"HTTP/1.1 200")
    finally:
        slow.close()
        silent.close()


def test_every_response_closes_its_connection(ready_server):
    _, port = ready_server()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):  # returns b"" only because the server closes
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data.lower()


def test_past_the_cap_the_oldest_slow_connection_makes_room(ready_server):
    server, port = ready_server(max_connections=4, head_timeout=60)
    slow = [_partial(port) for _ in range(4)]
    try:
        assert _get(port).startswith(b"HTTP/1.1 200")  # took the place of the oldest
        assert _closed_within(slow[0], 5.0) and not _closed_within(slow[1], 0.2)
        assert server.guard.evicted == 1
    finally:
        for s in slow:
            s.close()


def test_past_the_cap_with_every_connection_busy_a_new_one_is_closed_at_once():
    import threading

    release = threading.Event()

    def collect():
        release.wait(10)
        return entries("ready")

    server = HealthServer(build_app(collect), "127.0.0.1", 0, max_connections=2)
    port = server.start()
    busy = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole head: being answered
            busy.append(s)
        deadline = time.monotonic() + 5
        while sum(c.head_done for c in server.guard.open) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert _closed_within(extra, 2.0) and server.guard.refused == 1
        extra.close()
        release.set()
        assert busy[0].recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        release.set()
        for s in busy:
            s.close()
        server.stop()


def test_connection_cap_follows_the_descriptor_limit():
    import resource

    from weightcache.preload.http_guard import MAX_CONNECTIONS, NOFILE_SHARE, connection_cap

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert connection_cap() == 256 // NOFILE_SHARE
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert connection_cap() == min(MAX_CONNECTIONS, soft // NOFILE_SHARE)


SLOW_LORIS_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))
from weightcache.key import CacheKey
from weightcache.preload.http import DaemonEntry, HealthServer, build_app
from weightcache.wire import DaemonStatus
st = DaemonStatus(state="ready", key=CacheKey(model="m", content_digest="d"), device="cpu", pid=1, started_at=0.0)
server = HealthServer(build_app(lambda: [DaemonEntry("main", 0, "s", status=st)]), "127.0.0.1", 0)
print(server.start(), server.guard.max_connections, flush=True)
sys.stdin.read()
"""


class SlowLoris:
    """`n` connections that each send part of a request head and a byte now and then, reopened when closed."""

    def __init__(self, port: int, n: int):
        import threading

        self.port, self.stop = port, threading.Event()
        self.socks = [self._open() for _ in range(n)]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        try:
            return _partial(self.port, timeout=0.5)
        except OSError:
            return None

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            for i, s in enumerate(self.socks):
                if self.stop.is_set():
                    return
                try:
                    if s is not None and s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b"":
                        continue
                except BlockingIOError:
                    with contextlib.suppress(OSError):
                        s.send(b"X")
                    continue
                except OSError:
                    pass
                if s is not None:
                    s.close()
                self.socks[i] = self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            if s is not None:
                s.close()


def test_slow_loris_cannot_take_the_health_port():
    """A few hundred slow clients against a server with 256 descriptors: /health keeps answering, and the
    server holds a bounded number of descriptors (the rest stays with the supervisor)."""
    import statistics
    import subprocess
    import sys

    nofile = 256
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LORIS_SERVER.format(nofile=nofile)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    attack = None
    try:
        port, cap = map(int, proc.stdout.readline().split())
        fds = lambda: len(os.listdir(f"/proc/{proc.pid}/fd"))  # noqa: E731
        base = fds()
        attack = SlowLoris(port, nofile + 50)
        time.sleep(1.0)
        latency, peak = [], fds()
        for _ in range(20):
            t = time.perf_counter()
            assert _get(port).startswith(b"HTTP/1.1 200")  # raises after 3 s without an answer
            latency.append(time.perf_counter() - t)
            peak = max(peak, fds())
            time.sleep(0.05)
        assert peak <= base + 2 * cap + 4, (peak, base, cap)  # open ones, plus one accept round at most
        assert statistics.median(latency) < 0.25, latency  # about 1 ms here; bench/http_slowloris.py measures
    finally:
        if attack is not None:
            attack.close()
        proc.stdin.close()
        proc.wait(10)


# --- what the health port shows to any local user ---

def _with_paths():
    current = entries("ready", "loading")
    for e in current:
        e.status = status(e.rank, e.status.state, key=CacheKey(model="/home/alice/models/secret-llama",
                                                                content_digest="sha256:aa", rank=e.rank))
    current.append(DaemonEntry("draft", 0, "/tmp/x/draft-r0.sock", pid=777, alive=True,
                               error="no daemon at /tmp/x/draft-r0.sock (no such socket)"))
    return current


def test_status_shows_no_pids_or_paths_without_details():
    current = _with_paths()
    info = {"node_rank": 0, "socket_dir": "/run/user/1000/weightcache", "custodian": {"up": True, "pid": 55,
                                                                                     "socket": "/run/x/c.ctl"}}
    client = TestClient(build_app(lambda: current, info=lambda: info))
    text = client.get("/status").text + client.get("/health").text + client.get("/metrics").text
    for secret in ("/home/alice", "/tmp/x", "/run/", '"pid"', '"socket"', "socket_dir"):
        assert secret not in text, secret
    body = client.get("/status").json()
    assert body["details"] is False and body["custodian"] == {"up": True}
    d = body["daemons"][0]
    assert d["status"]["key"]["model"] == "secret-llama" and d["state"] == "ready" and d["status"]["nbytes"] == 4096
    assert body["daemons"][2]["error"] == "no daemon at draft-r0.sock (no such socket)"
    assert "draft rank 0: unreachable (no daemon at draft-r0.sock (no such socket))" in client.get("/health").text
    assert 'model="secret-llama"' in client.get("/metrics").text


def test_status_details_on_request():
    current = _with_paths()
    client = TestClient(build_app(lambda: current, info=lambda: {"socket_dir": "/run/x"}, details=True))
    body = client.get("/status").json()
    assert body["details"] is True and body["socket_dir"] == "/run/x"
    assert body["daemons"][0]["pid"] == 100 and body["daemons"][0]["socket"] == "/tmp/x/main-r0.sock"
    assert body["daemons"][0]["status"]["key"]["model"] == "/home/alice/models/secret-llama"
    assert 'model="/home/alice/models/secret-llama"' in client.get("/metrics").text


@pytest.mark.parametrize("text, shown", [
    ("/models/llama", "llama"),
    ("no daemon at /tmp/x/main-r0.sock: refused", "no daemon at main-r0.sock: refused"),
    ("cannot read '/x/y/z.json' (oops)", "cannot read 'z.json' (oops)"),
    ("/a/b/", "b"),
    ("http://10.0.0.1:80/health and org/model", "http://10.0.0.1:80/health and org/model"),
    ("process exited with code -9", "process exited with code -9"),
    ("sha256:abc", "sha256:abc"),
])
def test_strip_paths(text, shown):
    from weightcache.preload.http import strip_paths

    assert strip_paths(text) == shown


@pytest.mark.slow
def test_a_preload_under_slow_loris_still_replaces_a_killed_daemon(tmp_path):
    """The finding end to end: a preload with 256 descriptors, a few hundred slow clients on its health port,
    a daemon SIGKILLed meanwhile: /health keeps answering and the replacement starts."""
    import json
    import resource
    import signal
    import subprocess
    import sys

    from safetensors.torch import save_file

    model, sdir = tmp_path / "m", tmp_path / "s"
    model.mkdir()
    save_file({"w": torch.ones(256, 256)}, str(model / "model.safetensors"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", str(model), "--engine", "safetensors", "--device", "cpu",
         "--weight-cache-socket-dir", str(sdir), "--weight-cache-health-port", "0", "--weight-cache-status-details"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "preload.stderr", "w"), text=True, env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    attack = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("weightcache READY"), (tmp_path / "preload.stderr").read_text()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        attack = SlowLoris(port, 300)
        time.sleep(1.0)
        assert _get(port).startswith(b"HTTP/1.1 200")
        body = _get(port, "/status").split(b"\r\n\r\n", 1)[1]
        os.kill(json.loads(body)["daemons"][0]["pid"], signal.SIGKILL)
        seen, deadline = set(), time.monotonic() + 120
        while not (seen >= {503} and _get(port).startswith(b"HTTP/1.1 200")):
            seen.add(int(_get(port)[9:12]))
            assert time.monotonic() < deadline, (seen, (tmp_path / "preload.stderr").read_text())
            time.sleep(0.1)
        assert "is back (replacement 1" in (tmp_path / "preload.stderr").read_text()
    finally:
        if attack is not None:
            attack.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "preload.stderr").read_text()
    assert "Too many open files" not in (tmp_path / "preload.stderr").read_text()
