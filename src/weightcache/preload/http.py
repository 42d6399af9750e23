"""/health, /metrics (Prometheus) and /status (JSON) over the local daemons, served by uvicorn in a thread."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from .http_guard import HEAD_TIMEOUT_S, REQUEST_TIMEOUT_S, Guard, close_after_response, connection_cap

log = logging.getLogger(__name__)


@dataclass
class DaemonEntry:
    """One expected daemon as the supervisor sees it, plus its DaemonStatus when it answered."""

    role: str
    rank: int
    socket: str
    device: str = ""
    pid: int | None = None
    alive: bool = True  # the process is running
    exitcode: int | None = None
    status: object | None = None  # wire.DaemonStatus
    error: str = ""  # why there is no status
    restarts: int = 0  # daemons started in place of one that died after READY

    @property
    def state(self) -> str:
        if not self.alive:
            return "exited"
        if self.status is None:
            return "unreachable"
        if getattr(self.status, "verify_result", "") == "mismatch":
            return "weights changed"  # its resident bytes differ from their digests: it refuses attaches
        return self.status.state

    @property
    def ready(self) -> bool:
        return self.alive and self.status is not None and self.state == "ready"

    def to_json(self) -> dict:
        out = {
            "role": self.role, "rank": self.rank, "socket": self.socket, "device": self.device, "pid": self.pid,
            "alive": self.alive, "exitcode": self.exitcode, "state": self.state, "error": self.error,
            "restarts": self.restarts,
        }
        out["status"] = msgspec.to_builtins(self.status) if self.status is not None else None
        return out


Collect = Callable[[], list[DaemonEntry]]
Extra = Callable[[], list[tuple[str, str, float]]]  # more gauges: (name, help, value)


def healthy(entries: list[DaemonEntry]) -> bool:
    return bool(entries) and all(e.ready for e in entries)


def _collector(entries: list[DaemonEntry], extra: list[tuple[str, str, float]] = (),
               model_name: Callable[[str], str] | None = None):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    from ..wire import ATTACH_BUCKETS

    class _Collector:
        def collect(self):
            labels = ["role", "rank", "device", "model"]
            g = {
                "up": GaugeMetricFamily("weightcache_daemon_up", "1 if the daemon process runs and answers", labels=labels),
                "ready": GaugeMetricFamily("weightcache_daemon_ready", "1 if the daemon holds its weights", labels=labels),
                "bytes": GaugeMetricFamily("weightcache_bytes", "bytes of weights held", labels=labels),
                "tensors": GaugeMetricFamily("weightcache_tensors", "tensors held", labels=labels),
                "blocks": GaugeMetricFamily("weightcache_blocks", "exportable arena blocks", labels=labels),
                "clients": GaugeMetricFamily("weightcache_clients_attached", "clients attached now", labels=labels),
                "load_done": GaugeMetricFamily("weightcache_load_bytes_done", "bytes loaded so far", labels=labels),
                "load_total": GaugeMetricFamily("weightcache_load_bytes_total", "bytes to load", labels=labels),
                "load_s": GaugeMetricFamily("weightcache_load_duration_seconds", "time the load took", labels=labels),
                "load_rate": GaugeMetricFamily("weightcache_load_bytes_per_second",
                                               "load rate: so far while loading, over the whole load once ready",
                                               labels=labels),
                "start": GaugeMetricFamily("weightcache_start_time_seconds", "unix time the daemon started",
                                           labels=labels),
                "adopted": GaugeMetricFamily("weightcache_daemon_adopted", "1 if the daemon took its weights from "
                                             "the custodian (no load)", labels=labels),
                "held": GaugeMetricFamily("weightcache_cache_held", "1 if the custodian holds a copy (the cache "
                                          "outlives the daemon)", labels=labels),
                "verify_ok": GaugeMetricFamily("weightcache_verify_ok", "1 if the last re-hash of the resident "
                                               "weights matched their digests, 0 if not (absent: never verified)",
                                               labels=labels),
                "verified_at": GaugeMetricFamily("weightcache_verified_time_seconds", "unix time of the last "
                                                 "re-hash of the resident weights", labels=labels),
                "verify_s": GaugeMetricFamily("weightcache_verify_duration_seconds", "time the last re-hash took",
                                              labels=labels),
                "digest_s": GaugeMetricFamily("weightcache_digest_duration_seconds", "time recording (or, after an "
                                              "adoption, checking) the digests took", labels=labels),
            }
            c = {
                "attaches": CounterMetricFamily("weightcache_attaches", "attaches served", labels=labels),
                "refused": CounterMetricFamily("weightcache_attaches_refused", "attaches refused", labels=labels),
                "served": CounterMetricFamily("weightcache_bytes_served", "bytes handed to clients", labels=labels),
                "restarts": CounterMetricFamily("weightcache_daemon_restarts", "daemons started in place of one "
                                                "that died after READY", labels=labels),
                "verifications": CounterMetricFamily("weightcache_verifications", "re-hashes of the resident "
                                                     "weights (requests and scrubs)", labels=labels),
            }
            hist = HistogramMetricFamily("weightcache_attach_seconds", "time to serve one attach", labels=labels)
            for e in entries:
                s = e.status
                model = s.key.model if s is not None else ""
                model = model_name(model) if model_name else model
                device = (s.device if s is not None else "") or e.device
                lv = [e.role, str(e.rank), device, model]
                g["up"].add_metric(lv, 1.0 if e.alive and s is not None else 0.0)
                g["ready"].add_metric(lv, 1.0 if e.ready else 0.0)
                c["restarts"].add_metric(lv, float(e.restarts))
                if s is None:
                    continue
                for name, value in [("bytes", s.nbytes), ("tensors", s.ntensors), ("blocks", s.nblocks),
                                    ("clients", s.clients_attached), ("load_done", s.done),
                                    ("load_total", s.total), ("load_s", s.load_seconds),
                                    ("load_rate", s.load_bytes_per_second), ("start", s.started_at)]:
                    g[name].add_metric(lv, float(value))
                g["adopted"].add_metric(lv, 1.0 if getattr(s, "adopted", False) else 0.0)
                g["held"].add_metric(lv, 1.0 if getattr(s, "held", False) else 0.0)
                if getattr(s, "verify_result", ""):
                    g["verify_ok"].add_metric(lv, 1.0 if s.verify_result == "ok" else 0.0)
                    g["verified_at"].add_metric(lv, float(s.verified_at))
                    g["verify_s"].add_metric(lv, float(s.verify_seconds))
                g["digest_s"].add_metric(lv, float(getattr(s, "digest_seconds", 0.0)))
                c["verifications"].add_metric(lv, float(getattr(s, "verifications", 0)))
                c["attaches"].add_metric(lv, float(s.attaches_served))
                c["refused"].add_metric(lv, float(getattr(s, "attaches_refused", 0)))
                c["served"].add_metric(lv, float(s.bytes_served))
                counts = list(s.attach_seconds_buckets) or [0] * len(ATTACH_BUCKETS)
                buckets = [(repr(float(b)), float(n)) for b, n in zip(ATTACH_BUCKETS, counts, strict=False)]
                buckets.append(("+Inf", float(s.attach_seconds_count)))
                hist.add_metric(lv, buckets, float(s.attach_seconds_sum))
            yield from g.values()
            yield from c.values()
            yield hist
            for name, doc, value in extra:
                gauge = GaugeMetricFamily(name, doc)
                gauge.add_metric([], float(value))
                yield gauge

    return _Collector()


def render_metrics(entries: list[DaemonEntry], extra: list[tuple[str, str, float]] = (),
                   model_name: Callable[[str], str] | None = None) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_collector(entries, extra, model_name))
    return generate_latest(registry)


# Without --weight-cache-status-details, what the health port shows leaves out what only the operator needs:
# process ids, socket paths, and directories in model names and messages (a path keeps its last part).
HIDDEN_FIELDS = frozenset({"pid", "socket", "socket_dir", "supervisor_pid"})
_SEG = r"[^\s/'\":,;()\[\]]+"
_PATH = re.compile(rf"(?<![\w.~:/-])/(?:{_SEG}/)*({_SEG})/?")


def strip_paths(text: str) -> str:
    """Every absolute path in `text` cut to its last part: "/models/llama" -> "llama"."""
    return _PATH.sub(r"\1", text)


def redact(obj):
    """A JSON-able value without HIDDEN_FIELDS and with every absolute path cut to its last part."""
    if isinstance(obj, dict):
        return {k: redact(v) for k, v in obj.items() if k not in HIDDEN_FIELDS}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return strip_paths(obj)
    return obj


def build_app(collect: Collect, info: Callable[[], dict] | None = None, extra: Extra | None = None, *,
              details: bool = False):
    """A FastAPI app over `collect()`, which returns the local daemons' entries (queried at request time).
    Without `details`, no answer names a pid, a socket or a directory (see HIDDEN_FIELDS)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST

    app = FastAPI(title="weightcache", docs_url=None, redoc_url=None, openapi_url=None)
    shown = (lambda x: x) if details else redact

    @app.get("/health")
    def health():
        entries = collect()
        ok = healthy(entries)
        bad = [f"{e.role} rank {e.rank}: {e.state}" + (f" ({e.error})" if e.error else "")
               + (f" ({e.status.verify_message})" if e.state == "weights changed" else "")
               for e in entries if not e.ready]
        body = {"status": "ok" if ok else "unavailable", "daemons": len(entries), "not_ready": shown(bad)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics():
        body = render_metrics(collect(), extra() if extra else (), model_name=None if details else strip_paths)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    def status():
        entries = collect()
        body = {"healthy": healthy(entries), "time": time.time(), **(info() if info else {}),
                "daemons": [e.to_json() for e in entries], "details": details}
        return JSONResponse(shown(body))

    return app


class HealthServer:
    """uvicorn in a background thread, behind a guard (http_guard) that bounds how long a request head may take
    and how many connections are open; the supervisor keeps the signals."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, max_connections: int | None = None,
                 head_timeout: float = HEAD_TIMEOUT_S, request_timeout: float = REQUEST_TIMEOUT_S):
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        cap = connection_cap() if max_connections is None else max_connections
        self.guard = Guard(cap, head_timeout, request_timeout)
        config = uvicorn.Config(close_after_response(app), host=host, port=port, log_level="warning",
                                lifespan="off", access_log=False, ws="none",
                                http=self.guard.protocol(AutoHTTPProtocol),
                                backlog=max(8, cap))  # also how many connections one accept round takes
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._error: list[BaseException] = []

    def start(self, timeout: float = 10.0) -> int:
        def run():
            try:
                self.server.run()
            except BaseException as e:  # uvicorn exits with SystemExit when it cannot bind
                self._error.append(e)

        self._thread = threading.Thread(target=run, name="weightcache-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error or not self._thread.is_alive():
                raise OSError(f"cannot serve HTTP on {self.host}:{self.port} (is the port in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"HTTP server on {self.host}:{self.port} did not start in {timeout:.0f} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def daemon_entries(children, restarts: dict) -> list[DaemonEntry]:
    """A supervisor's children (``preload.child.Child``) as entries, each daemon asked for its status now."""
    from ..client import query_status

    out = []
    for c in children:
        c.drain()
        p = c.spec.placement
        e = DaemonEntry(c.spec.role, p.rank, c.socket, device=p.device, pid=c.proc.pid,
                        restarts=restarts.get((c.spec.role, p.rank), 0))
        e.alive = not c.exited
        if not e.alive:
            e.exitcode = c.proc.exitcode
            e.error = f"process exited with code {c.proc.exitcode}"
        elif not c.socket:
            e.error = "starting (not listening yet)"
        else:
            try:
                e.status = query_status(c.socket, timeout=1.0)
            except Exception as ex:
                e.error = str(ex) or type(ex).__name__
        out.append(e)
    return out
