"""One rank's daemon: holds the arena, its manifest and its key, and serves attach/status over a Unix socket."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from . import wire
from .arena import allocate_block
from .errors import ProtocolError, SocketInUse
from .key import CacheKey, diff
from .manifest import (
    DEFAULT_BLOCK_BYTES,
    Manifest,
    build_views,
    plan_for_metas,
    plan_for_tensors,
    release_storage,
    storage_bytes,
)
from .naming import ensure_private_dir

log = logging.getLogger("weightcache.daemon")

IDLE_TIMEOUT = 60.0  # a connection that is not attached must send a request this often


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket left by a dead daemon; refuse to touch a live one or a non-socket file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.warning("removing stale socket %s (its daemon is gone)", path)
        path.unlink(missing_ok=True)
        return
    except OSError as e:
        raise SocketInUse(f"cannot probe existing socket {path}: {e}") from None
    finally:
        probe.close()
    raise SocketInUse(f"a live daemon already serves {path}")


class Daemon:
    def __init__(
        self,
        socket_path: str | Path,
        key: CacheKey,
        *,
        device: str | torch.device = "cpu",
        allowed_uids: Iterable[int] | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        hello_timeout: float = 5.0,
        max_clients: int = 256,
        info: dict[str, str] | None = None,
    ):
        self.socket_path = Path(socket_path)
        self.key = key
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.allowed_uids = {os.getuid(), *(allowed_uids or ())}
        self.block_bytes = block_bytes
        self.hello_timeout = hello_timeout
        self.max_clients = max_clients
        self.info = dict(info or {})
        self.state = "starting"
        self.message = ""
        self.manifest: Manifest | None = None
        self._attached_frame = b""  # the encoded Attached reply, the same for every client once ready
        self._blocks: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._signalled = False
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._started_at = time.time()
        self._done = self._total = 0
        self._load_seconds = 0.0
        self._load_t0 = 0.0  # time.monotonic() when the load began
        self._counters = {"clients_attached": 0, "attaches_served": 0, "attaches_refused": 0, "bytes_served": 0}
        self._attach_sum = 0.0
        self._attach_count = 0
        self._attach_buckets = [0] * len(wire.ATTACH_BUCKETS)
        self._gpu_uuid = ""
        self._peak_device_bytes = self._baseline_device_bytes = 0
        if self.device.type == "cuda":
            from .arena.cuda import gpu_uuid

            self._gpu_uuid = gpu_uuid(self.device.index)
            free, total = torch.cuda.mem_get_info(self.device)
            self._baseline_device_bytes = total - free

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve in the background; state becomes "loading"."""
        ensure_private_dir(self.socket_path.parent)
        _remove_stale_socket(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o666 if len(self.allowed_uids) > 1 else 0o600)
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        self.state = "loading"
        threading.Thread(target=self._accept_loop, name="weightcache-accept", daemon=True).start()
        if self.device.type == "cuda":
            threading.Thread(target=self._watch_peak, name="weightcache-peak", daemon=True).start()
        log.info("daemon for %s rank %d listening on %s", self.key.model, self.key.rank, self.socket_path)

    def _progress(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    def _load_rate(self) -> float:
        """Bytes per second: so far while loading, over the whole load once ready."""
        if self._load_seconds > 0:
            return self._done / self._load_seconds
        if self._load_t0 and self.state == "loading":
            return self._done / max(time.monotonic() - self._load_t0, 1e-6)
        return 0.0

    def _allocate(self, manifest: Manifest) -> list[torch.Tensor]:
        blocks = []
        try:
            for spec in manifest.blocks:
                blocks.append(allocate_block(spec.nbytes, self.device))
        except BaseException:
            for b in blocks:
                b.close()
            raise
        for spec, b in zip(manifest.blocks, blocks, strict=True):
            spec.nbytes = b.nbytes  # rounded up to the page / VMM granularity
        manifest.device = self.device.type
        manifest.gpu_uuid = self._gpu_uuid
        self._blocks = blocks
        return [b.tensor for b in blocks]

    def _finish(self, manifest: Manifest, t0: float) -> None:
        for b in self._blocks:
            b.seal()
        self.manifest = manifest
        self._attached_frame = wire.encode(wire.Attached(key=self.key, manifest=manifest, nfds=len(self._blocks)))
        self._load_seconds = time.monotonic() - t0
        self.state = "ready"
        log.info(
            "ready: %d tensors, %.2f GiB in %d block(s) on %s, loaded in %.2f s (%.2f GB/s)",
            len(manifest.tensors), manifest.nbytes / 2**30, len(manifest.blocks), self.device, self._load_seconds,
            self._load_rate() / 1e9,
        )

    def load(self, source) -> None:
        """Plan from the source's description, allocate the arena, let the source fill it in place."""
        t0 = self._load_t0 = time.monotonic()
        try:
            manifest = plan_for_metas(source.describe(), self.block_bytes)
            self._total = sum(s.nbytes for s in manifest.storages)
            views = build_views(manifest, self._allocate(manifest))
            source.fill(views, self._progress)
            self._finish(manifest, t0)
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str] | None = None, *,
                     consume: bool = False) -> None:
        """Pack existing tensors (storage sharing, strides and offsets kept).

        With ``consume``, the tensors are the engine's freshly built weights and are consumed: blocks are
        allocated one at a time, each filled from the source storages and then those storages are freed
        (resized to 0 bytes, whoever else still refers to them), so the peak stays near 1x the weights plus
        one block (``capture_block_bytes``)."""
        t0 = self._load_t0 = time.monotonic()
        try:
            manifest, spans = plan_for_tensors(tensors, roles, self.block_bytes, consume=consume)
            self._total = sum(end - start for _, start, end in spans)
            if not consume:
                blocks = self._allocate(manifest)
                for spec, (t, start, end) in zip(manifest.storages, spans, strict=True):
                    blocks[spec.block][spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
                    self._progress(end - start)
            else:
                self._capture(manifest, spans)
            self._finish(manifest, t0)
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise

    def _capture(self, manifest: Manifest, spans) -> None:
        """Fill block after block, freeing each source storage once its bytes are in the arena."""
        by_block: list[list[int]] = [[] for _ in manifest.blocks]
        for i, spec in enumerate(manifest.storages):
            by_block[spec.block].append(i)
        kept = 0
        try:
            for bi, members in enumerate(by_block):
                block = allocate_block(manifest.blocks[bi].nbytes, self.device)
                self._blocks.append(block)
                self._sample_peak()
                for i in members:
                    spec, (t, start, end) = manifest.storages[i], spans[i]
                    block.tensor[spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
                    self._progress(end - start)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                for i in members:
                    kept += release_storage(spans[i][0])
                    spans[i] = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # hand the freed memory back to the driver for the next block
        except BaseException:
            for b in self._blocks:
                b.close()
            self._blocks = []
            raise
        for spec, b in zip(manifest.blocks, self._blocks, strict=True):
            spec.nbytes = b.nbytes
        manifest.device = self.device.type
        manifest.gpu_uuid = self._gpu_uuid
        if kept:
            log.info("%.1f MiB of source storage could not be released early (not resizable)", kept / 2**20)

    def _sample_peak(self) -> None:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._peak_device_bytes = max(self._peak_device_bytes, total - free - self._baseline_device_bytes)

    def _watch_peak(self) -> None:
        """Device memory in use above the daemon's start, sampled while it loads (CUDA)."""
        while self.state in ("starting", "loading") and not self._stop.is_set():
            self._sample_peak()
            time.sleep(0.01)
        self._sample_peak()

    def fail(self, message: str) -> None:
        self.state, self.message = "failed", message
        log.error("daemon failed: %s", message)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop serve_forever() cleanly (main thread only). The handler only sets a flag:
        Event.set() takes a lock the interrupted main thread may hold inside Event.wait() (a deadlock)."""
        def stop(*_):
            self._signalled = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)

    def serve_forever(self) -> None:
        """Block until close() or, in the main thread, SIGTERM/SIGINT."""
        if threading.current_thread() is threading.main_thread():
            self.install_signal_handlers()
        try:
            while not (self._stop.is_set() or self._signalled):
                time.sleep(0.1)
        finally:
            self.close()

    def close(self) -> None:
        if self.state == "closed":
            return
        self._stop.set()
        self.state = "closed"
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                if os.path.exists(self.socket_path):
                    self.socket_path.unlink()
            except OSError:
                pass
        with self._lock:
            conns = list(self._connections)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for b in self._blocks:
            b.close()  # memory lives on in attached engines until they drop their views
        self._blocks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- status -----------------------------------------------------------------------------------------

    def status(self) -> wire.DaemonStatus:
        m = self.manifest
        with self._lock:
            cumulative, acc = [], 0
            for n in self._attach_buckets:
                acc += n
                cumulative.append(acc)
            return wire.DaemonStatus(
                state=self.state, message=self.message, done=self._done, total=self._total, key=self.key,
                device=str(self.device), gpu_uuid=self._gpu_uuid, pid=os.getpid(),
                nbytes=m.nbytes if m else 0, ntensors=len(m.tensors) if m else 0, nblocks=len(m.blocks) if m else 0,
                started_at=self._started_at, load_seconds=self._load_seconds,
                load_bytes_per_second=self._load_rate(),
                peak_device_bytes=self._peak_device_bytes,
                attach_seconds_sum=self._attach_sum, attach_seconds_count=self._attach_count,
                attach_seconds_buckets=cumulative, info=self.info, **self._counters,
            )

    # ---- serving ----------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                busy = len(self._connections) >= self.max_clients
                if not busy:
                    self._connections.add(conn)
            if busy:
                self._refuse(conn, "busy", f"daemon serves {self.max_clients} connections already; retry later")
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), name="weightcache-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket, code: str, message: str, diffs=()) -> None:
        with self._lock:
            self._counters["attaches_refused"] += code in ("key_mismatch", "permission", "version")
        try:
            conn.settimeout(1.0)
            wire.send_msg(conn, wire.Error(code=code, message=message, diffs=list(diffs)))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_connection(self, conn: socket.socket) -> None:
        attached = False
        try:
            pid, uid, _ = wire.peer_credentials(conn)
            if uid not in self.allowed_uids:
                log.warning("refused pid %d: uid %d not allowed", pid, uid)
                self._refuse(conn, "permission", f"uid {uid} is not allowed to attach (allowed: {sorted(self.allowed_uids)})")
                return
            first = True
            while not self._stop.is_set():
                deadline = None if attached else time.monotonic() + (self.hello_timeout if first else IDLE_TIMEOUT)
                if attached:
                    conn.settimeout(None)
                try:
                    msg = wire.recv_msg(conn, deadline=deadline)
                except EOFError:
                    return
                except (TimeoutError, ProtocolError) as e:
                    self._refuse(conn, "protocol", str(e))
                    return
                first = False
                if isinstance(msg, wire.Ping):
                    wire.send_msg(conn, wire.Pong())
                elif isinstance(msg, wire.StatusRequest):
                    wire.send_msg(conn, self.status())
                elif isinstance(msg, wire.Hello) and not attached:
                    attached = self._handle_hello(conn, msg)
                    if attached is None:
                        return
                else:
                    self._refuse(conn, "protocol", f"unexpected message {type(msg).__name__}")
                    return
        except OSError:
            return  # peer vanished; nothing of ours is lost
        except Exception:
            log.exception("error while serving a client")
        finally:
            with self._lock:
                self._connections.discard(conn)
                if attached:
                    self._counters["clients_attached"] -= 1
            conn.close()

    def _count_attach(self, clients: int, attaches: int, nbytes: int) -> None:
        with self._lock:
            self._counters["clients_attached"] += clients
            self._counters["attaches_served"] += attaches
            self._counters["bytes_served"] += nbytes

    def _handle_hello(self, conn: socket.socket, hello: wire.Hello) -> bool | None:
        """Returns True once attached, False if the client may ask again (not ready), None if refused."""
        t0 = time.monotonic()
        if hello.protocol != wire.PROTOCOL_VERSION:
            self._refuse(conn, "version", f"protocol {hello.protocol} not supported (daemon speaks {wire.PROTOCOL_VERSION})")
            return None
        if hello.mode not in ("map", "copy"):
            self._refuse(conn, "protocol", f"unknown mode {hello.mode!r} (map or copy)")
            return None
        if hello.expect is not None:
            diffs = diff(hello.expect, self.key)
            if diffs:
                self._refuse(conn, "key_mismatch", "the daemon holds other weights", diffs)
                return None
        if self.state == "failed":
            self._refuse(conn, "failed", f"daemon failed to load: {self.message}")
            return None
        if self.state != "ready":
            wire.send_msg(conn, wire.NotReady(state=self.state, done=self._done, total=self._total, message=self.message))
            return False
        manifest = self.manifest
        readonly = hello.readonly or hello.mode == "copy"
        fds = [b.export_fd(readonly) for b in self._blocks]
        served = (1, 1, manifest.nbytes)  # counted before the client can see its attach complete
        self._count_attach(*served)
        try:
            wire.send_frame(conn, self._attached_frame)
            wire.send_fds(conn, fds)
        except BaseException:
            self._count_attach(*(-n for n in served))
            raise
        finally:
            for fd in fds:
                os.close(fd)
        elapsed = time.monotonic() - t0
        with self._lock:
            self._attach_sum += elapsed
            self._attach_count += 1
            for i, bound in enumerate(wire.ATTACH_BUCKETS):
                if elapsed <= bound:
                    self._attach_buckets[i] += 1
                    break
        return True
