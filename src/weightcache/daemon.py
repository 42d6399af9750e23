"""One rank's daemon: holds the arena, its manifest and its key, and serves attach/status over a Unix socket.

torch is imported only to load: a daemon that takes its cache over from the custodian serves it without."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from . import integrity, wire
from .errors import ProtocolError, WeightCacheError
from .gpus import DeviceSpec
from .handover import Handover
from .integrity.guard import ResidentGuard
from .key import CacheKey, diff
from .manifest import DEFAULT_BLOCK_BYTES, Manifest, plan_for_metas
from .server import OUT_OF_DESCRIPTORS, UnixServer

log = logging.getLogger("weightcache.daemon")

IDLE_TIMEOUT = 60.0  # a connection that is not attached is dropped this long after its last Hello
MAX_PER_PEER = 64  # connections one process may hold (attached or not)
STATUS_RESERVE = 8  # connections past max_clients that may only ask for status


class Daemon:
    def __init__(
        self,
        socket_path: str | Path | None,
        key: CacheKey | None,
        *,
        device="cpu",
        allowed_uids: Iterable[int] | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        hello_timeout: float = 5.0,
        idle_timeout: float = IDLE_TIMEOUT,
        max_clients: int = 256,
        max_per_peer: int = MAX_PER_PEER,
        status_reserve: int = STATUS_RESERVE,
        info: dict[str, str] | None = None,
        custodian: str | Path | None = None,
        gpu_uuid: str | None = None,
        digest_chunk_bytes: int = integrity.DEFAULT_CHUNK_BYTES,
        scrub_interval: float = 0.0,
    ):
        self.device = DeviceSpec.of(device)
        self.block_bytes = block_bytes
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self._server_args = dict(allowed_uids=allowed_uids or (), max_clients=max_clients,
                                 max_per_peer=max_per_peer, status_reserve=status_reserve)
        self._custodian = custodian
        self._named = threading.Event()  # the socket and key are known (a load may begin before: see name())
        self._naming = threading.Lock()
        self._unnamed_because: BaseException | None = None
        self.socket_path: Path | None = None
        self.key: CacheKey | None = None
        self.server: UnixServer | None = None
        self.handover: Handover | None = None  # the custodian: hands the cache to a replacement daemon
        self.info = dict(info or {})
        self.state = "starting"
        self.message = ""
        self.manifest: Manifest | None = None
        self._attached_frame = b""  # the encoded Attached reply, the same for every client once ready
        self._blocks: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._signalled = False
        self._started_at = time.time()
        self._done = self._total = 0
        self._load_seconds = 0.0
        self._load_t0 = 0.0  # time.monotonic() when the load began
        self._counters = {"clients_attached": 0, "attaches_served": 0, "attaches_refused": 0, "bytes_served": 0}
        self._attach_sum = 0.0
        self._attach_count = 0
        self._attach_buckets = [0] * len(wire.ATTACH_BUCKETS)
        self._gpu_uuid = ""
        self.adopted = False  # the weights were taken over from the custodian, not loaded
        self.held = False  # the custodian holds a copy: the cache outlives this daemon
        self._started_mono = time.monotonic()
        self._ready_seconds = 0.0
        self._peak = None  # memwatch.PeakWatch once a load starts (CUDA)
        self.phases: dict[str, float] = {}  # where the load's time went (a producer adds its own)
        # digests recorded at load (digest_chunk_bytes 0: none), re-hashed on request and every scrub_interval s
        self.guard = ResidentGuard(self.device, digest_chunk_bytes, scrub_interval)
        if self.device.type == "cuda":
            self._gpu_uuid = gpu_uuid or self._torch_gpu_uuid()
        if socket_path is not None and key is not None:
            self.name(socket_path, key)

    def name(self, socket_path: str | Path, key: CacheKey, *, start: bool = False,
             then: Callable[[], None] | None = None) -> None:
        """The socket and key, once known; with ``start`` the socket is bound, then ``then()`` runs. A daemon
        made without them may begin to load while its key waits for the checkpoint's digest; its load waits for
        this (``then`` included) before it seals and deposits the weights."""
        with self._naming:  # never a socket bound after close()
            if self._stop.is_set():
                raise RuntimeError("the daemon was closed before its cache key was known")
            self.socket_path, self.key = Path(socket_path), key
            self.server = UnixServer(self.socket_path, self._serve_connection, self._refuse, what="daemon",
                                     **self._server_args)
            # while connected, the custodian knows we serve this cache
            self.handover = Handover(self._custodian, self.socket_path.name) if self._custodian else None
            if start:
                self.start()
        if then is not None:
            then()
        self._named.set()

    def cannot_be_named(self, why: BaseException) -> None:
        """The key could not be made: a load that waits for it ends with this error."""
        self._unnamed_because = why
        self._named.set()

    def _await_name(self) -> float:
        """Seconds waited for the key (none once named): not part of the load's time."""
        if self._named.is_set():
            return 0.0
        log.info("loaded; waiting for the checkpoint's digest (the cache key)")
        t = time.monotonic()
        while not self._named.wait(0.5):
            if self._stop.is_set():
                raise RuntimeError("stopped while waiting for the cache key")
        if self._unnamed_because is not None:
            raise self._unnamed_because
        self.phases["key wait"] = waited = time.monotonic() - t
        return waited

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve in the background; state becomes "loading"."""
        self.server.bind()
        self._started_mono = time.monotonic()
        if self.state == "starting":  # a load that began before the key may have failed meanwhile
            self.state = "loading"
        self.server.start()
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

    def _torch_gpu_uuid(self) -> str:
        from .arena.cuda import gpu_uuid

        return gpu_uuid(self.device.index)

    def _watch_memory(self) -> None:
        """Sample the device memory in use above this point while the daemon loads (CUDA, once)."""
        if self.device.type == "cuda" and self._peak is None:
            from .memwatch import PeakWatch

            self._peak = PeakWatch(self.device.index, lambda: self.state in ("starting", "loading")
                                   and not self._stop.is_set())

    def _sample_peak(self) -> None:
        if self._peak is not None:
            self._peak.sample()

    def _allocate(self, manifest: Manifest) -> list:
        from .arena import allocate_block

        blocks = []
        try:
            for spec in manifest.blocks:
                blocks.append(allocate_block(spec.nbytes, self.device.torch()))
        except BaseException:
            for b in blocks:
                b.close()
            raise
        self._blocks = blocks
        self._describe_blocks(manifest)
        return [b.tensor for b in blocks]

    def _describe_blocks(self, manifest: Manifest) -> None:
        for spec, b in zip(manifest.blocks, self._blocks, strict=True):
            spec.nbytes = b.nbytes  # rounded up to the page / VMM granularity
        manifest.device = self.device.type
        manifest.gpu_uuid = self._gpu_uuid

    def _finish(self, manifest: Manifest, t0: float) -> None:
        t0 += self._await_name()
        self._sample_peak()  # the sampler thread may not have run since the arena was allocated
        for b in self._blocks:
            b.seal()
        if not self.adopted:
            t = time.monotonic()
            self.guard.record(manifest, self._blocks)
            self.phases["digests"] = time.monotonic() - t
        self.manifest = manifest
        self._attached_frame = wire.encode(wire.Attached(key=self.key, manifest=manifest, nfds=len(self._blocks)))
        self._load_seconds = time.monotonic() - t0
        if not self.adopted:
            t = time.monotonic()
            self._deposit(manifest)
            self.phases["deposit"] = time.monotonic() - t
        self.state = "ready"
        self._ready_seconds = time.monotonic() - self._started_mono
        self.guard.start_scrub(self.verify_resident, self._stop)
        log.info(
            "ready: %d tensors, %.2f GiB in %d block(s) on %s, %s in %.3f s%s",
            len(manifest.tensors), manifest.nbytes / 2**30, len(manifest.blocks), self.device,
            "taken over from the custodian (no load)" if self.adopted else "loaded", self._load_seconds,
            "" if self.adopted else f" ({self._load_rate() / 1e9:.2f} GB/s)",
        )

    # ---- verified resident weights (integrity/guard.py) -------------------------------------------------

    def verify_resident(self) -> wire.VerifyReport:
        """Re-hash the resident bytes on the daemon's device against the digests recorded at load. A mismatch
        is logged and shown in status, and every later attach is refused, naming the tensors."""
        return self.guard.verify(self.manifest, self._blocks, self.state)

    def _adopted_bytes_match(self, manifest: Manifest) -> bool:
        """A cache taken from the custodian is served only if its bytes match its recorded digests; one that
        does not (a poisoned or damaged deposit) is released so that this daemon loads afresh."""
        name = self.handover.name if self.handover else self.socket_path.name
        why = self.guard.check_adopted(manifest, self._blocks, name)
        if not why:
            return True
        log.warning("the custodian's cache %s is not the bytes that were loaded: %s; releasing it, loading afresh",
                    name, why)
        for b in self._blocks:
            b.close()
        self._blocks = []
        client = self.handover.client() if self.handover else None
        if client is not None:
            try:
                client.release([name])
            except WeightCacheError as e:
                log.warning("could not release %s at the custodian: %s", name, e)
        return False

    # ---- the custodian: the cache outlives this daemon --------------------------------------------------

    def _deposit(self, manifest: Manifest) -> None:
        if self.handover is not None:
            self.held = self.handover.deposit(self.key, manifest, [b.fd for b in self._blocks],
                                              device=self.device.type, gpu_uuid=self._gpu_uuid)

    def adopt(self) -> bool:
        """Serve the cache the custodian holds for this socket name, without a load: its key must equal ours
        field by field. False when it holds none; one it holds that does not fit is released."""
        if self.handover is None:
            return False
        t0 = time.monotonic()
        got = self.handover.adopt(self.key, self.device.type, self._gpu_uuid)
        if got is None:
            return False
        manifest, self._blocks = got
        if not self._adopted_bytes_match(manifest):
            return False
        self.adopted = self.held = True
        self._finish(manifest, t0)
        return True

    def load(self, source) -> None:
        """Plan from a FillSource's description, allocate the arena, let the source fill it in place."""
        from .packing import build_views

        t0 = self._load_t0 = time.monotonic()
        self._watch_memory()
        try:
            source.prepare()  # its staging buffers made while the arena is allocated
            manifest = plan_for_metas(source.describe(), self.block_bytes)
            self._total = sum(s.nbytes for s in manifest.storages)
            views = build_views(manifest, self._allocate(manifest))
            source.fill(views, self._progress)
            del views  # the writable views go before the blocks are sealed
            self._finish(manifest, t0)
        except BaseException as e:
            source.release()
            self.fail(f"{type(e).__name__}: {e}")
            raise

    def load_tensors(self, tensors: Mapping, roles: Mapping[str, str] | None = None, *,
                     consume: bool = False, began: float | None = None) -> None:
        """Pack existing tensors (storage sharing, strides and offsets kept).

        With ``consume``, the tensors are the engine's freshly built weights and are consumed: blocks are
        allocated one at a time, each filled from the source storages and then those storages are freed
        (resized to 0 bytes, whoever else still refers to them), so the peak stays near 1x the weights plus
        one block (``capture_block_bytes``). ``began`` (``time.monotonic()``): when the engine's loader started
        building them, so the load time and rate reported cover the whole load, not only the packing."""
        from .packing import plan_for_tensors, storage_bytes

        t0 = self._load_t0 = time.monotonic() if began is None else began
        self._watch_memory()
        packing = time.monotonic()
        try:
            manifest, spans = plan_for_tensors(tensors, roles, self.block_bytes, consume=consume)
            with self._lock:
                self._done, self._total = 0, sum(end - start for _, start, end in spans)
            if not consume:
                blocks = self._allocate(manifest)
                for spec, (t, start, end) in zip(manifest.storages, spans, strict=True):
                    blocks[spec.block][spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
                    self._progress(end - start)
                del blocks  # the writable views go before the blocks are sealed
            else:
                self._capture(manifest, spans)
            self.phases["pack"] = time.monotonic() - packing
            self._finish(manifest, t0)
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise

    def begin_load(self, total: int) -> None:
        """A producer starts building the weights: ``total`` bytes it will read (progress until it packs)."""
        with self._lock:
            self._load_t0 = time.monotonic()
            self._done, self._total = 0, total
        self._watch_memory()

    def _capture(self, manifest: Manifest, spans) -> None:
        """Fill block after block, freeing each source storage once its bytes are in the arena."""
        from .packing import pack_consuming

        kept = pack_consuming(manifest, spans, self.device.torch(), self._blocks, self._progress, self._sample_peak)
        self._describe_blocks(manifest)
        if kept:
            log.info("%.1f MiB of source storage could not be released early (not resizable)", kept / 2**20)

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
        with self._naming:
            if self.state == "closed":
                return
            self._stop.set()
            self.state = "closed"
        if self.server is not None:
            self.server.close()
        for b in self._blocks:
            b.close()  # memory lives on in attached engines (and the custodian) until they drop it
        self._blocks = []
        if self.handover is not None:
            self.handover.close()  # what we deposited stays held for a replacement

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
                peak_device_bytes=self._peak.peak if self._peak else 0, adopted=self.adopted, held=self.held,
                ready_seconds=self._ready_seconds, load_bytes_per_second=self._load_rate(),
                attach_seconds_sum=self._attach_sum, attach_seconds_count=self._attach_count,
                attach_seconds_buckets=cumulative, info=self.info, phases=dict(self.phases), **self._counters,
                integrity=m.integrity if m else "", **self.guard.status(),
            )

    # ---- serving ----------------------------------------------------------------------------------------

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

    def _serve_connection(self, conn: socket.socket, peer: tuple[int, int], status_only: bool = False) -> None:
        """Serve one client (the server admitted it). Until it attaches it must keep asking: the first request
        within hello_timeout, then a Hello (one that waits for the load) at least every idle_timeout; pings
        and status requests do not keep a connection open. A status-only connection gets one answer."""
        attached = False
        try:
            deadline = time.monotonic() + self.hello_timeout
            first = True
            while not self._stop.is_set():
                if attached:
                    conn.settimeout(None)
                try:
                    msg = wire.recv_msg(conn, wire.MAX_REQUEST_FRAME, deadline=None if attached else deadline)
                except EOFError:
                    return
                except TimeoutError as e:
                    why = "no request" if first else "no attach"
                    self._refuse(conn, "protocol", f"{why} in time, closing ({e})")
                    return
                except ProtocolError as e:
                    self._refuse(conn, "protocol", str(e))
                    return
                if first:
                    first = False
                    deadline = time.monotonic() + self.idle_timeout
                if isinstance(msg, wire.Ping):
                    wire.send_msg(conn, wire.Pong())
                elif isinstance(msg, wire.StatusRequest):
                    wire.send_msg(conn, self.status())
                elif isinstance(msg, wire.VerifyRequest):
                    wire.send_msg(conn, self.verify_resident())
                elif isinstance(msg, wire.Hello) and not attached:
                    if status_only:
                        self._refuse(conn, "busy", f"daemon serves {self.server.max_clients} connections already; "
                                                   "retry later")
                        return
                    attached = self._handle_hello(conn, msg)
                    if attached is None:
                        return
                    deadline = time.monotonic() + self.idle_timeout  # waiting for the load: still wanted
                else:
                    self._refuse(conn, "protocol", f"unexpected message {type(msg).__name__}")
                    return
                if status_only:
                    return
        finally:
            if attached:
                with self._lock:
                    self._counters["clients_attached"] -= 1

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
        refusal = self.guard.refusal()
        if refusal:
            self._refuse(conn, "failed", refusal)
            return None
        if self.state != "ready":
            wire.send_msg(conn, wire.NotReady(state=self.state, done=self._done, total=self._total, message=self.message))
            return False
        manifest = self.manifest
        readonly = hello.readonly or hello.mode == "copy"
        try:
            fds = self._export_fds(readonly)
        except OSError as e:
            if e.errno not in OUT_OF_DESCRIPTORS:
                raise
            self._refuse(conn, "busy", f"daemon is out of file descriptors ({e.strerror}); retry later")
            return None
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

    def _export_fds(self, readonly: bool) -> list[int]:
        fds: list[int] = []
        try:
            for b in self._blocks:
                fds.append(b.export_fd(readonly))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds
