"""One rank's daemon: holds the arena, its manifest and its key, and serves attach/status over a Unix socket."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
import torch

from . import wire
from .arena import allocate_block
from .errors import ProtocolError, SocketInUse, WeightCacheError
from .key import CacheKey, diff
from .manifest import (
    DEFAULT_BLOCK_BYTES,
    Manifest,
    build_views,
    plan_for_metas,
    plan_for_tensors,
    release_storage,
    storage_bytes,
    validate,
)
from .naming import check_socket_path, ensure_private_dir

log = logging.getLogger("weightcache.daemon")

IDLE_TIMEOUT = 60.0  # a connection that is not attached is dropped this long after its last Hello
MAX_PER_PEER = 64  # connections one process may hold (attached or not)
STATUS_RESERVE = 8  # connections past max_clients that may only ask for status
ACCEPT_QUIET = 2.0  # seconds without an accept error that end an episode of them
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


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
        idle_timeout: float = IDLE_TIMEOUT,
        max_clients: int = 256,
        max_per_peer: int = MAX_PER_PEER,
        status_reserve: int = STATUS_RESERVE,
        info: dict[str, str] | None = None,
        custodian: str | Path | None = None,
    ):
        self.socket_path = Path(socket_path)
        self.key = key
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.allowed_uids = {os.getuid(), *(allowed_uids or ())}
        self.block_bytes = block_bytes
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.max_clients = max_clients
        self.max_per_peer = max_per_peer
        self.status_reserve = status_reserve
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
        self._per_peer: dict[tuple[int, int], int] = {}  # (uid, pid) -> open connections
        self._started_at = time.time()
        self._done = self._total = 0
        self._load_seconds = 0.0
        self._load_t0 = 0.0  # time.monotonic() when the load began
        self._counters = {"clients_attached": 0, "attaches_served": 0, "attaches_refused": 0, "bytes_served": 0}
        self._attach_sum = 0.0
        self._attach_count = 0
        self._attach_buckets = [0] * len(wire.ATTACH_BUCKETS)
        self._gpu_uuid = ""
        self.custodian_path = Path(custodian) if custodian else None  # hands the cache to a replacement daemon
        self._custodian = None  # our connection: the custodian knows we serve what we deposited or claimed
        self.adopted = False  # the weights were taken over from the custodian, not loaded
        self.held = False  # the custodian holds a copy: the cache outlives this daemon
        self._started_mono = time.monotonic()
        self._ready_seconds = 0.0
        self._peak_device_bytes = self._baseline_device_bytes = 0
        if self.device.type == "cuda":
            from .arena.cuda import gpu_uuid

            self._gpu_uuid = gpu_uuid(self.device.index)
            free, total = torch.cuda.mem_get_info(self.device)
            self._baseline_device_bytes = total - free

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve in the background; state becomes "loading"."""
        check_socket_path(self.socket_path)
        ensure_private_dir(self.socket_path.parent)
        _remove_stale_socket(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o666 if len(self.allowed_uids) > 1 else 0o600)
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        self._started_mono = time.monotonic()
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
        self._blocks = blocks
        self._describe_blocks(manifest)
        return [b.tensor for b in blocks]

    def _describe_blocks(self, manifest: Manifest) -> None:
        for spec, b in zip(manifest.blocks, self._blocks, strict=True):
            spec.nbytes = b.nbytes  # rounded up to the page / VMM granularity
        manifest.device = self.device.type
        manifest.gpu_uuid = self._gpu_uuid

    def _finish(self, manifest: Manifest, t0: float) -> None:
        self._sample_peak()  # the sampler thread may not have run since the arena was allocated
        for b in self._blocks:
            b.seal()
        self.manifest = manifest
        self._attached_frame = wire.encode(wire.Attached(key=self.key, manifest=manifest, nfds=len(self._blocks)))
        self._load_seconds = time.monotonic() - t0
        if not self.adopted:
            self._deposit(manifest)
        self.state = "ready"
        self._ready_seconds = time.monotonic() - self._started_mono
        log.info(
            "ready: %d tensors, %.2f GiB in %d block(s) on %s, %s in %.3f s%s",
            len(manifest.tensors), manifest.nbytes / 2**30, len(manifest.blocks), self.device,
            "taken over from the custodian (no load)" if self.adopted else "loaded", self._load_seconds,
            "" if self.adopted else f" ({self._load_rate() / 1e9:.2f} GB/s)",
        )

    # ---- the custodian: the cache outlives this daemon --------------------------------------------------

    def _custodian_client(self):
        if self.custodian_path is None:
            return None
        if self._custodian is None:
            from .custodian import CustodianClient

            try:
                self._custodian = CustodianClient.connect(self.custodian_path, client=f"daemon {self.socket_path.name}")
            except WeightCacheError as e:
                log.warning("no custodian (%s): this rank's cache will not outlive its daemon", e)
                self.custodian_path = None
        return self._custodian

    def _deposit(self, manifest: Manifest) -> None:
        client = self._custodian_client()
        if client is None:
            return
        from .custodian import Holding

        holding = Holding(name=self.socket_path.name, model=self.key.model, role=self.key.role, rank=self.key.rank,
                          device=self.device.type, gpu_uuid=self._gpu_uuid,
                          block_bytes=[b.nbytes for b in manifest.blocks])
        try:
            client.deposit(holding, msgspec.msgpack.encode(self.key), msgspec.msgpack.encode(manifest),
                           [b.fd for b in self._blocks])
            self.held = True
        except WeightCacheError as e:
            log.warning("the custodian did not take this rank's cache (%s): it will not outlive this daemon", e)

    def adopt(self) -> bool:
        """Serve the cache the custodian holds for this socket name, without a load: its key must equal ours
        field by field. False when it holds none; one it holds that does not fit is released."""
        client = self._custodian_client()
        if client is None:
            return False
        t0 = time.monotonic()
        name = self.socket_path.name
        try:
            got = client.claim(name)
        except WeightCacheError as e:
            log.warning("custodian: %s; loading afresh", e)
            return False
        if got is None:
            return False
        claimed, fds = got
        try:
            manifest = self._check_claimed(claimed, len(fds))
            from .arena.adopted import AdoptedBlock

            blocks = []
            for fd, spec in zip(fds, manifest.blocks, strict=True):
                blocks.append(AdoptedBlock(fd, spec.nbytes, self.device.type))
        except (ValueError, WeightCacheError, msgspec.DecodeError, OSError) as e:
            for fd in fds:
                os.close(fd)
            log.warning("the custodian's cache %s does not fit this daemon (%s): releasing it, loading afresh",
                        name, e)
            try:
                client.release([name])
            except WeightCacheError:
                pass
            return False
        self._blocks = blocks
        self.adopted = self.held = True
        self._finish(manifest, t0)
        return True

    def _check_claimed(self, claimed, nfds: int) -> Manifest:
        held_key = msgspec.msgpack.decode(claimed.key, type=CacheKey)
        diffs = diff(self.key, held_key)
        if diffs:
            raise ValueError("its key differs: " + ", ".join(
                f"{d.field}: held {d.actual!r}, this daemon {d.expected!r}" for d in diffs))
        manifest = msgspec.msgpack.decode(claimed.manifest, type=Manifest)
        validate(manifest)
        if nfds != len(manifest.blocks) or [b.nbytes for b in manifest.blocks] != claimed.holding.block_bytes:
            raise ValueError(f"{nfds} block fds for {len(manifest.blocks)} blocks")
        if manifest.device != self.device.type or manifest.gpu_uuid != self._gpu_uuid:
            raise ValueError(f"held on {manifest.device} {manifest.gpu_uuid}, this daemon serves {self.device} "
                             f"{self._gpu_uuid}")
        return manifest

    def load(self, source) -> None:
        """Plan from the source's description, allocate the arena, let the source fill it in place."""
        t0 = self._load_t0 = time.monotonic()
        try:
            if hasattr(source, "prepare_fill"):
                source.prepare_fill()  # its staging buffers made while the arena is allocated
            manifest = plan_for_metas(source.describe(), self.block_bytes)
            self._total = sum(s.nbytes for s in manifest.storages)
            views = build_views(manifest, self._allocate(manifest))
            source.fill(views, self._progress)
            del views  # the writable views go before the blocks are sealed
            self._finish(manifest, t0)
        except BaseException as e:
            if hasattr(source, "release_prepared"):
                source.release_prepared()
            self.fail(f"{type(e).__name__}: {e}")
            raise

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str] | None = None, *,
                     consume: bool = False, began: float | None = None) -> None:
        """Pack existing tensors (storage sharing, strides and offsets kept).

        With ``consume``, the tensors are the engine's freshly built weights and are consumed: blocks are
        allocated one at a time, each filled from the source storages and then those storages are freed
        (resized to 0 bytes, whoever else still refers to them), so the peak stays near 1x the weights plus
        one block (``capture_block_bytes``). ``began`` (``time.monotonic()``): when the engine's loader started
        building them, so the load time and rate reported cover the whole load, not only the packing."""
        t0 = self._load_t0 = time.monotonic() if began is None else began
        try:
            manifest, spans = plan_for_tensors(tensors, roles, self.block_bytes, consume=consume)
            self._total = sum(end - start for _, start, end in spans)
            if not consume:
                blocks = self._allocate(manifest)
                for spec, (t, start, end) in zip(manifest.storages, spans, strict=True):
                    blocks[spec.block][spec.offset:spec.offset + end - start].copy_(storage_bytes(t, start, end))
                    self._progress(end - start)
                del blocks  # the writable views go before the blocks are sealed
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
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # hand the freed memory back to the driver for the next block
        except BaseException:
            for b in self._blocks:
                b.close()
            self._blocks = []
            raise
        self._describe_blocks(manifest)
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
            b.close()  # memory lives on in attached engines (and the custodian) until they drop it
        self._blocks = []
        if self._custodian is not None:
            self._custodian.close()  # what we deposited stays held for a replacement
            self._custodian = None

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
                peak_device_bytes=self._peak_device_bytes, adopted=self.adopted, held=self.held,
                ready_seconds=self._ready_seconds, load_bytes_per_second=self._load_rate(),
                attach_seconds_sum=self._attach_sum, attach_seconds_count=self._attach_count,
                attach_seconds_buckets=cumulative, info=self.info, **self._counters,
            )

    # ---- serving ----------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept until closed. Running out of descriptors (EMFILE/ENFILE) or any other accept error never
        ends the loop: it backs off (up to 1 s) and serves again once it can, logging once per episode (an
        episode ends after ACCEPT_QUIET seconds without an error)."""
        backoff = 0.0
        trouble_since = last_error = None
        while not self._stop.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set() or self._listener is None:
                    return
                last_error = time.monotonic()
                if trouble_since is None:
                    trouble_since = last_error
                    with self._lock:
                        n = len(self._connections)
                    hint = " (out of file descriptors)" if e.errno in _OUT_OF_DESCRIPTORS else ""
                    log.warning("cannot accept connections%s: %s; %d connection(s) open; retrying until it can",
                                hint, e.strerror or e, n)
                backoff = min(max(2 * backoff, 0.01), 1.0)
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            if trouble_since is not None and time.monotonic() - last_error > ACCEPT_QUIET:
                log.warning("accepting connections again (for %.1f s it could not)", last_error - trouble_since)
                trouble_since = None
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Count the connection against the daemon's and its process's limits; past max_clients a few more
        are let in for status requests only, so that `weightcache status` works through a flood."""
        try:
            pid, uid, _ = wire.peer_credentials(conn)
        except OSError:
            conn.close()
            return
        peer = (uid, pid)
        with self._lock:
            total, mine = len(self._connections), self._per_peer.get(peer, 0)
            full = total >= self.max_clients + self.status_reserve
            if not full and mine < self.max_per_peer:
                self._connections.add(conn)
                self._per_peer[peer] = mine + 1
        if full:
            self._refuse(conn, "busy", f"daemon serves {total} connections already; retry later")
        elif mine >= self.max_per_peer:
            self._refuse(conn, "busy", f"process {pid} holds {mine} connections already (at most "
                                       f"{self.max_per_peer}); close some or retry later")
        else:
            threading.Thread(target=self._serve_connection, args=(conn, peer, total >= self.max_clients),
                             name="weightcache-conn", daemon=True).start()

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
        """Serve one client. Until it attaches it must keep asking: the first request within hello_timeout,
        then a Hello (one that waits for the load) at least every idle_timeout; pings and status requests
        do not keep a connection open. A status-only connection gets one answer."""
        attached = False
        uid, pid = peer
        try:
            if uid not in self.allowed_uids:
                log.warning("refused pid %d: uid %d not allowed", pid, uid)
                self._refuse(conn, "permission", f"uid {uid} is not allowed to attach (allowed: {sorted(self.allowed_uids)})")
                return
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
                elif isinstance(msg, wire.Hello) and not attached:
                    if status_only:
                        self._refuse(conn, "busy", f"daemon serves {self.max_clients} connections already; "
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
        except OSError:
            return  # peer vanished; nothing of ours is lost
        except Exception:
            log.exception("error while serving a client")
        finally:
            with self._lock:
                self._connections.discard(conn)
                left = self._per_peer.get(peer, 1) - 1
                if left > 0:
                    self._per_peer[peer] = left
                else:
                    self._per_peer.pop(peer, None)
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
        try:
            fds = self._export_fds(readonly)
        except OSError as e:
            if e.errno not in _OUT_OF_DESCRIPTORS:
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
