"""The HTTP app over daemon entries, and over a real uvicorn server on loopback."""

from __future__ import annotations

import time

import httpx
import pytest

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
