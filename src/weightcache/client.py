"""Engine side: connect to a rank's daemon, verify its key, import its blocks, and build tensor views."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from . import wire
from .arena import import_blocks
from .errors import (
    DaemonBusy,
    DaemonNotReady,
    DaemonUnavailable,
    KeyMismatch,
    PermissionDenied,
    ProtocolError,
    WeightCacheError,
)
from .key import CacheKey, check
from .manifest import Manifest, validate
from .packing import build_views

log = logging.getLogger("weightcache.client")


def _connect(path: str | Path, timeout: float) -> socket.socket:
    path = str(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except FileNotFoundError:
        sock.close()
        raise DaemonUnavailable(f"no weight cache daemon at {path} (no such socket)") from None
    except ConnectionRefusedError:
        sock.close()
        raise DaemonUnavailable(f"stale socket {path}: its daemon is gone") from None
    except PermissionError:
        sock.close()
        raise PermissionDenied(f"not allowed to connect to {path} (socket permissions)") from None
    except (TimeoutError, BlockingIOError) as e:  # its backlog is full: it is not accepting fast enough
        sock.close()
        raise DaemonBusy(f"daemon at {path} did not accept the connection ({e}); retry later") from None
    except OSError as e:
        if e.errno == errno.EAGAIN:
            sock.close()
            raise DaemonBusy(f"daemon at {path} did not accept the connection ({e}); retry later") from None
        sock.close()
        raise DaemonUnavailable(f"cannot connect to {path}: {e}") from None
    return sock


def _raise_error(msg: wire.Error, path: str) -> None:
    if msg.code == "key_mismatch":
        raise KeyMismatch(msg.diffs, path)
    if msg.code == "permission":
        raise PermissionDenied(f"{path}: {msg.message}")
    if msg.code == "failed":
        raise DaemonNotReady("failed", message=msg.message)
    if msg.code in ("protocol", "version"):
        raise ProtocolError(f"{path}: {msg.message}")
    if msg.code == "busy":
        raise DaemonBusy(f"{path}: daemon busy: {msg.message}")
    raise WeightCacheError(f"{path}: daemon refused ({msg.code}): {msg.message}")


def _request(sock: socket.socket, msg, path: str, timeout: float):
    try:
        wire.send_msg(sock, msg)
    except OSError:
        timeout = min(timeout, 1.0)  # it hung up: maybe after saying why (busy), read that
    try:
        reply = wire.recv_msg(sock, deadline=time.monotonic() + timeout)
    except (EOFError, ConnectionError):
        raise DaemonUnavailable(f"daemon at {path} closed the connection") from None
    except TimeoutError:
        raise DaemonUnavailable(f"daemon at {path} did not answer within {timeout:.1f} s") from None
    if isinstance(reply, wire.Error):
        _raise_error(reply, path)
    return reply


def _ask(path: str | Path, request, expected: type, what: str, timeout: float, connect_timeout: float):
    """One request on a connection of its own, and its reply of type ``expected`` ("a `what` reply")."""
    sock = _connect(path, connect_timeout)
    try:
        reply = _request(sock, request, str(path), timeout)
    finally:
        sock.close()
    if not isinstance(reply, expected):
        raise ProtocolError(f"{path}: expected a {what} reply, got {type(reply).__name__}")
    return reply


def query_status(path: str | Path, timeout: float = 2.0) -> wire.DaemonStatus:
    return _ask(path, wire.StatusRequest(), wire.DaemonStatus, "status", timeout, timeout)


def request_verify(path: str | Path, timeout: float = 300.0) -> wire.VerifyReport:
    """Ask a daemon to re-hash its resident bytes (on its own device) against the digests it recorded."""
    return _ask(path, wire.VerifyRequest(), wire.VerifyReport, "verify", timeout, min(timeout, 10.0))


def wait_ready(path: str | Path, timeout: float, on_progress=None, poll: float = 0.2) -> wire.DaemonStatus:
    """Poll a daemon until it is ready; raises DaemonNotReady if it failed or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        st = query_status(path)
        if st.state == "ready":
            return st
        if st.state == "failed":
            raise DaemonNotReady("failed", st.done, st.total, st.message)
        if on_progress:
            on_progress(st)
        if time.monotonic() >= deadline:
            raise DaemonNotReady(st.state, st.done, st.total, f"still not ready after {timeout:.0f} s")
        time.sleep(poll)


class _Watch:
    """One thread watches every attached connection: a daemon sends nothing after an attach, so a readable
    connection means the daemon is gone (or broke the protocol)."""

    def __init__(self):
        self._sel = selectors.DefaultSelector()
        # reentrant: an Attachment's finalizer (forget) can run from a GC pass inside add() on the same thread
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()  # a forked child shares the epoll instance: it leaves it alone

    def add(self, sock: socket.socket, on_lost) -> None:
        thread = None
        with self._lock:
            self._sel.register(sock, selectors.EVENT_READ, on_lost)
            current = self._thread
            if current is None or (current.ident is not None and not current.is_alive()):
                thread = self._thread = threading.Thread(target=self._run, name="weightcache-watch", daemon=True)
        # started without the lock: until start() returns, the new thread may run a finalizer (a GC pass) that
        # calls forget() and needs it
        if thread is not None:
            thread.start()

    def forget(self, sock: socket.socket) -> None:
        if os.getpid() != self._pid:
            return
        with self._lock:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass

    def forget_and_close(self, sock: socket.socket) -> None:
        self.forget(sock)
        sock.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._sel.get_map():
                    self._thread = None
                    return
            for key, _ in self._sel.select(timeout=0.5):
                sock = key.fileobj
                try:
                    if sock.recv(4096, socket.MSG_DONTWAIT):
                        continue  # nothing is expected; ignore it
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self.forget(sock)
                key.data()


_watch = _Watch()


def _new_watch_after_fork() -> None:
    global _watch
    _watch = _Watch()


os.register_at_fork(after_in_child=_new_watch_after_fork)


class Attachment(Mapping[str, torch.Tensor]):
    """Tensors attached from a daemon. Views stay valid while referenced, even after close() or the daemon's
    death (the driver/kernel refcounts the memory). While attached, the connection is watched: if the daemon
    dies, one line is logged and `daemon_lost` turns True; a later attach finds its replacement."""

    def __init__(self, sock, key: CacheKey, manifest: Manifest, tensors: dict[str, torch.Tensor], device, mode,
                 timings: dict[str, float] | None = None, path: str = ""):
        self._sock = sock
        self.path = path
        self.daemon_lost = False
        self.timings = timings or {}
        self.key = key
        self.manifest = manifest
        self.tensors = tensors
        self.device = device
        self.mode = mode
        self.roles = manifest.roles()
        self.nbytes = manifest.nbytes
        if sock is not None:
            ref = weakref.ref(self)

            def lost():
                att = ref()
                if att is not None:
                    att._daemon_lost()

            _watch.add(sock, lost)
            weakref.finalize(self, _watch.forget_and_close, sock)  # dropped without close(): detach

    def _daemon_lost(self) -> None:
        if self._sock is None:
            return  # closed by us
        self.daemon_lost = True
        log.warning("weight cache daemon at %s is gone: the %d attached tensors (%.2f GiB) stay valid; a later "
                    "attach finds its replacement", self.path, len(self.tensors), self.nbytes / 2**30)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        """Detach: tell the daemon (by closing the connection) and drop our references."""
        sock, self._sock = self._sock, None
        if sock is not None:
            _watch.forget_and_close(sock)
        self.tensors = {}

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Attachment({self.key.model!r} rank {self.key.rank}, {len(self)} tensors, {self.nbytes} bytes, {self.device})"


def _device_for(manifest: Manifest) -> torch.device:
    if manifest.device == "cpu":
        return torch.device("cpu")
    if manifest.device == "cuda":
        from .arena.cuda import device_index_for_uuid

        return torch.device("cuda", device_index_for_uuid(manifest.gpu_uuid))
    raise ProtocolError(f"unknown arena device {manifest.device!r}")


@contextlib.contextmanager
def _collector_paused():
    """Thousands of short-lived objects are made while attaching; a collection of an engine's large heap
    in the middle would cost more than the whole attach. The collector resumes afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _copy_blocks(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.empty_like(b) for b in blocks]
    for dst, src in zip(out, blocks, strict=True):
        dst.copy_(src)
    if blocks and blocks[0].is_cuda:
        torch.cuda.synchronize(blocks[0].device)
    return out


def _verify_blocks(path: str, manifest: Manifest, blocks: list[torch.Tensor]) -> None:
    """Re-hash the attached blocks here, on their device, against the digests the daemon recorded at load."""
    from . import integrity

    try:
        bad = integrity.check(manifest, blocks)
    except integrity.IntegrityError as e:
        raise integrity.IntegrityError(f"{path}: cannot verify the attached weights: {e}") from None
    if bad:
        raise integrity.IntegrityError(f"{path}: the attached weights are not the bytes the daemon loaded: "
                                       f"{integrity.describe(bad, manifest.chunk_bytes)}", bad)


def _take(sock, reply: wire.Attached, expect, path: str, mode: str, readonly: bool, verify: bool = False):
    """After an Attached reply: receive the block fds, check the key and manifest, import, build views."""
    fds = wire.recv_fds(sock, reply.nfds)
    t_manifest = time.perf_counter()
    manifest = reply.manifest
    try:
        if expect is not None:
            check(expect, reply.key, path)
        try:
            validate(manifest)
        except ValueError as e:
            raise ProtocolError(f"{path}: the daemon sent a bad manifest: {e}") from None
        if len(fds) != len(manifest.blocks):
            raise ProtocolError(f"{path}: got {len(fds)} block handles for {len(manifest.blocks)} blocks")
        device = _device_for(manifest)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    t_import = time.perf_counter()
    blocks = import_blocks(fds, [b.nbytes for b in manifest.blocks], device, readonly or mode == "copy")
    if mode == "copy":
        blocks = _copy_blocks(blocks)
    if verify:
        _verify_blocks(path, manifest, blocks)
    t_views = time.perf_counter()
    tensors = build_views(manifest, blocks)
    if device.type == "cpu" and mode == "map" and readonly:
        _name_write_faults(path, manifest, blocks)
    return manifest, device, tensors, (t_manifest, t_import, t_views, time.perf_counter())


def _tensors_at(manifest: Manifest, block: int, offset: int) -> list[str]:
    """Names of the tensors whose storage holds byte `offset` of `block` (the closest ones first)."""
    names = []
    for i, st in enumerate(manifest.storages):
        if st.block == block and st.offset <= offset < st.offset + st.nbytes:
            at = offset - st.offset
            mine = [t for t in manifest.tensors if t.storage == i]
            mine.sort(key=lambda t: (not t.byte_offset <= at, abs(at - t.byte_offset)))
            names += [t.name for t in mine]
    return names


def _name_write_faults(path: str, manifest: Manifest, blocks: list[torch.Tensor]) -> None:
    """A write to these read-only mappings kills the engine (SIGSEGV): have it say which tensor first."""
    from . import faults

    for i, b in enumerate(blocks):
        start = b.data_ptr()
        end = start + b.numel()

        def describe(addr: int, i=i, start=start, end=end) -> str:
            names = _tensors_at(manifest, i, addr - start)
            what = f"tensor {names[0]!r}" + (f" (storage shared with {', '.join(map(repr, names[1:4]))})"
                                               if len(names) > 1 else "") if names else "no tensor (padding)"
            return (f"weightcache: write to read-only weights at {addr:#x}: {what}, block {i} of {path} mapped "
                    f"at {start:#x}-{end:#x}; attached weights are shared and read-only, attach with "
                    f"mode=\"copy\" or readonly=False for writable tensors")

        faults.register(start, end, describe)


def attach(
    socket: str | Path,
    expect: CacheKey | None = None,
    *,
    mode: str = "map",
    readonly: bool = True,
    wait: float = 0.0,
    timeout: float = 10.0,
    verify: bool = False,
) -> Attachment:
    """Attach a daemon's weights. mode="map" maps them zero-copy and read-only; readonly=False makes them
    writable (on CPU a private copy-on-write mapping: the engine's writes stay its own; on CUDA a shared
    writable mapping); mode="copy" gives private writable tensors. While the daemon is loading, or is busy
    (DaemonBusy: too many connections), waits and retries up to `wait` seconds. ``verify=True`` re-hashes the
    attached bytes in this process (on their device) against the digests the daemon recorded at load and
    raises IntegrityError naming the tensors that differ (``timings["import"]`` then includes it)."""
    if mode not in ("map", "copy"):
        raise ValueError(f"mode must be 'map' or 'copy', not {mode!r}")
    path = str(socket)
    deadline = time.monotonic() + wait
    last_log = 0.0
    hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, mode=mode, readonly=readonly, expect=expect,
                       client=f"pid {os.getpid()}")
    t0 = time.perf_counter()
    sock = None
    busy_pause = 0.02
    try:
        while True:
            try:
                if sock is None:
                    sock = _connect(path, timeout)
                with _collector_paused():
                    reply = _request(sock, hello, path, timeout)
                    if isinstance(reply, wire.Attached):
                        manifest, device, tensors, marks = _take(sock, reply, expect, path, mode, readonly, verify)
                        break
            except DaemonBusy as e:  # refused at the door: a new connection may get in
                if sock is not None:
                    sock.close()
                    sock = None
                if time.monotonic() + busy_pause > deadline:
                    raise
                if time.monotonic() - last_log > 5.0:
                    log.info("%s; retrying for up to %.0f s more", e, deadline - time.monotonic())
                    last_log = time.monotonic()
                time.sleep(busy_pause)
                busy_pause = min(2 * busy_pause, 0.5)
                continue
            if not isinstance(reply, wire.NotReady):
                raise ProtocolError(f"{path}: unexpected reply {type(reply).__name__}")
            if time.monotonic() >= deadline:
                raise DaemonNotReady(reply.state, reply.done, reply.total, reply.message)
            if time.monotonic() - last_log > 5.0:
                pct = f"{100.0 * reply.done / reply.total:.0f}%" if reply.total else "?"
                log.info("waiting for the weight cache at %s to load (%s)", path, pct)
                last_log = time.monotonic()
            time.sleep(0.1)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    sock.settimeout(None)
    if mode == "copy":
        sock.close()  # private memory: nothing left to hold on the daemon's side
        sock = None
    t_manifest, t_import, t_views, t_end = marks
    timings = {"handshake": t_manifest - t0, "validate": t_import - t_manifest, "import": t_views - t_import,
               "views": t_end - t_views, "total": t_end - t0}
    return Attachment(sock, reply.key, manifest, tensors, device, mode, timings, path)
