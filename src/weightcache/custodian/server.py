"""The custodian: one small long-lived process per socket directory (per node and user) that holds a duplicate
of every rank's block descriptors with its manifest and key, so a cache outlives its daemon.

A CUDA VMM POSIX fd (like a memfd) alone keeps its allocation alive, and a process that never mapped it can
pass it on. A daemon deposits its exported block fds, its key and its manifest once its weights are ready; a
replacement daemon for the same socket name (role, rank, device and key) claims them and serves again without
a load: it hands clients dups of those very fds (an importer cannot re-export a VMM handle, so the custodian
holds the exported ones). The custodian never maps, decodes or imports anything: keys and manifests are
opaque msgpack bytes the daemons encode and check.

Lifetime: it lives while it holds a cache or while anyone is connected (a supervisor keeps a connection open
for as long as it runs). `weightcache release`, SIGTERM or its socket's removal frees what it holds; its
death frees it too once no daemon or engine maps it (the kernel or the driver refcounts the memory).

Protocol: typed msgspec messages in wire's framing (length-prefixed msgpack) over a Unix socket in the
private socket directory; the peer's uid is checked with SO_PEERCRED; fds travel with SCM_RIGHTS after the
frame that announces them. Never pickle.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import resource
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import msgspec

from .. import wire
from ..errors import ProtocolError, WeightCacheError
from ..sockets import custodian_socket_path, ensure_private_dir, take_over_path
from .messages import (
    MAX_BLOCKS,
    MAX_FRAME,
    PROTOCOL,
    Claim,
    Claimed,
    CustodianError,
    Deposit,
    Error,
    Held,
    Hello,
    Holding,
    Holdings,
    ListHoldings,
    Miss,
    Prune,
    Release,
    Released,
    Stop,
    Welcome,
    _decoder,
)

log = logging.getLogger("weightcache.custodian.server")

LINGER_S = 2.0  # nothing held and no one connected for this long: exit
FIRST_CONTACT_S = 30.0  # a fresh custodian waits this long for its first client
HELLO_TIMEOUT_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class _HangUp(Exception):
    """Answer with an error, then close: the stream can no longer be trusted to be in step."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------- messages

# ------------------------------------------------------------------------------------------------ server

class _Entry:
    def __init__(self, holding: Holding, key: bytes, manifest: bytes, fds: list[int]):
        self.holding, self.key, self.manifest, self.fds = holding, key, manifest, fds
        self.lease: socket.socket | None = None  # the connection of the daemon serving it

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _bind(path: Path) -> socket.socket | None:
    """Listen at `path`; None if a live custodian already does. A dead one's socket is replaced."""
    ensure_private_dir(path.parent)
    if not take_over_path(path, "custodian"):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    return listener


class Custodian:
    """The holder. `bind()` then `serve_forever()` (or `start()` for a background thread in tests)."""

    def __init__(self, socket_path: str | Path, *, linger: float = LINGER_S, first_contact: float = FIRST_CONTACT_S):
        self.socket_path = Path(socket_path)
        self.linger, self.first_contact = linger, first_contact
        self.started_at = time.time()
        self._entries: dict[str, _Entry] = {}
        self._conns: dict[socket.socket, int] = {}  # connection -> peer pid
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._signalled = False
        self._listener: socket.socket | None = None
        self._inode = 0
        self._idle_since = time.monotonic()
        self._contacted = False  # a client said hello: the first-contact wait is over
        self._closed = False

    # -- lifecycle

    def bind(self) -> bool:
        """Listen on the socket; False if another live custodian already serves this directory."""
        listener = _bind(self.socket_path)
        if listener is None:
            return False
        self._listener = listener
        self._inode = os.stat(self.socket_path).st_ino
        return True

    def start(self) -> None:
        """Serve in background threads (the listener must be bound)."""
        if self._listener is None and not self.bind():
            raise CustodianError(f"a custodian already serves {self.socket_path}")
        threading.Thread(target=self._accept_loop, name="custodian-accept", daemon=True).start()

    def serve_forever(self) -> None:
        """Serve until stopped, signalled, or idle (nothing held, no one connected); then release all."""
        if threading.current_thread() is threading.main_thread():
            def flag(*_):
                self._signalled = True

            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, flag)
        self.start()
        log.info("custodian pid %d serving %s", os.getpid(), self.socket_path)
        contact_by = time.monotonic() + self.first_contact
        try:
            while not self._stop.wait(0.2):
                if self._signalled:
                    log.info("signal received: releasing every cache and exiting")
                    break
                if not self._socket_is_ours():
                    log.warning("%s was removed or replaced: no one can reach this custodian; releasing every "
                                "cache and exiting", self.socket_path)
                    break
                with self._lock:
                    idle = not self._entries and not self._conns
                    if not idle:
                        self._idle_since = time.monotonic()
                    quiet = idle and time.monotonic() - self._idle_since >= self.linger
                if quiet and (self._contacted or time.monotonic() >= contact_by):
                    log.info("nothing held and no one connected: exiting")
                    break
        finally:
            self.close()

    def _socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self._inode
        except OSError:
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            entries = list(self._entries.values())
            self._entries.clear()
            conns = list(self._conns)
        freed = sum(e.holding.nbytes for e in entries)
        for e in entries:
            e.close()
        if entries:
            log.info("released %d cache(s), %.2f GiB", len(entries), freed / 2**30)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self._socket_is_ours():
                with contextlib.suppress(OSError):
                    self.socket_path.unlink()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def holdings(self) -> list[Holding]:
        with self._lock:
            return [msgspec.structs.replace(e.holding) for e in self._entries.values()]

    # -- serving

    def _accept_loop(self) -> None:
        listener = self._listener
        if listener is None:
            return
        poller = select.poll()  # not select(): a custodian holds many fds, select() stops at 1024
        poller.register(listener, select.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                conn, _ = listener.accept()
            except OSError as e:
                if self._stop.is_set() or listener.fileno() < 0:
                    return
                log.warning("accept failed (%s); retrying", e)  # fd exhaustion must not end the service
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="custodian-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pid = 0
        try:
            pid, uid, _ = wire.peer_credentials(conn)
            if uid != os.getuid():
                log.warning("refused pid %d: uid %d is not ours", pid, uid)
                self._reply_error(conn, "permission", f"uid {uid} may not talk to the custodian of uid {os.getuid()}")
                return
            try:
                hello = wire.recv_msg(conn, MAX_FRAME, time.monotonic() + HELLO_TIMEOUT_S, _decoder)
            except (EOFError, TimeoutError, ProtocolError) as e:
                self._reply_error(conn, "protocol", f"expected a hello: {e}")
                return
            if not isinstance(hello, Hello):
                self._reply_error(conn, "protocol", f"expected a hello, got {type(hello).__name__}")
                return
            if hello.protocol != PROTOCOL:
                self._reply_error(conn, "version", f"custodian protocol {hello.protocol} is not supported "
                                  f"(this custodian, pid {os.getpid()}, speaks {PROTOCOL})")
                return
            with self._lock:
                self._conns[conn] = pid
                self._contacted = True
            conn.settimeout(None)
            wire.send_msg(conn, Welcome(protocol=PROTOCOL, pid=os.getpid(), started_at=self.started_at))
            while not self._stop.is_set():
                try:
                    msg = wire.recv_msg(conn, MAX_FRAME, None, _decoder)
                except EOFError:
                    return
                except ProtocolError as e:
                    self._reply_error(conn, "protocol", str(e))
                    return
                if isinstance(msg, Stop):
                    wire.send_msg(conn, self._release(None, everything=True, why=f"stop asked by pid {pid}"))
                    self._stop.set()
                    return
                try:
                    reply = self._handle(conn, pid, msg)
                except _HangUp as e:
                    self._reply_error(conn, e.code, str(e))
                    return
                if reply is not None:
                    wire.send_msg(conn, reply)
        except OSError:
            return
        except Exception:
            log.exception("error while serving pid %d", pid)
        finally:
            self._drop(conn, pid)

    def _drop(self, conn: socket.socket, pid: int) -> None:
        with self._lock:
            self._conns.pop(conn, None)
            orphans = [e for e in self._entries.values() if e.lease is conn]
            for e in orphans:
                e.lease, e.holding.served_by = None, 0
        for e in orphans:
            if not self._stop.is_set():
                log.warning("daemon pid %d serving %s is gone; holding its %.2f GiB for a replacement", pid,
                            e.holding.name, e.holding.nbytes / 2**30)
        with contextlib.suppress(OSError):
            conn.close()

    def _reply_error(self, conn: socket.socket, code: str, message: str) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            wire.send_msg(conn, Error(code=code, message=message))
        conn.close()

    def _handle(self, conn: socket.socket, pid: int, msg):
        if isinstance(msg, Deposit):
            return self._deposit(conn, pid, msg)
        if isinstance(msg, Claim):
            return self._claim(conn, pid, msg)
        if isinstance(msg, Release):
            return self._release(msg.names, msg.everything, why=f"release asked by pid {pid}")
        if isinstance(msg, Prune):
            return self._prune(msg, pid)
        if isinstance(msg, ListHoldings):
            return Holdings(pid=os.getpid(), started_at=self.started_at, holdings=self.holdings())
        return Error(code="bad_request", message=f"unexpected message {type(msg).__name__}")

    def _deposit(self, conn: socket.socket, pid: int, msg: Deposit):
        h = msg.holding
        if not 0 < msg.nfds <= MAX_BLOCKS:
            raise _HangUp("bad_request", f"a cache needs 1 to {MAX_BLOCKS} blocks, not {msg.nfds}")
        fds = wire.recv_fds(conn, msg.nfds)  # after the frame, whatever we answer: the stream stays in step
        problem = self._check_deposit(h, fds)
        if problem:
            for fd in fds:
                os.close(fd)
            return Error(code="bad_request", message=problem)
        h.deposited_at, h.deposited_by, h.served_by, h.handovers = time.time(), pid, pid, 0
        entry = _Entry(h, msg.key, msg.manifest, fds)
        entry.lease = conn
        with self._lock:
            old = self._entries.pop(h.name, None)
            self._entries[h.name] = entry
        if old is not None:
            old.close()
        log.info("holding %s (%s rank %d of %s, %.2f GiB in %d block(s) on %s) for pid %d", h.name, h.role, h.rank,
                 h.model, h.nbytes / 2**30, len(fds), h.device, pid)
        return Held(holding=h, replaced=old is not None)

    @staticmethod
    def _check_deposit(h: Holding, fds: list[int]) -> str:
        if not _NAME.match(h.name):
            return f"bad cache name {h.name!r}"
        if len(fds) != len(h.block_bytes) or any(n <= 0 for n in h.block_bytes):
            return f"{h.name}: {len(fds)} block fds for {len(h.block_bytes)} block sizes"
        if h.device not in ("cpu", "cuda"):
            return f"{h.name}: unknown device {h.device!r}"
        if h.device == "cpu":  # memfds: each must be at least as large as its block
            for i, (fd, n) in enumerate(zip(fds, h.block_bytes, strict=True)):
                try:
                    size = os.fstat(fd).st_size
                except OSError as e:
                    return f"{h.name}: block {i}: {e}"
                if size < n:
                    return f"{h.name}: block {i} is {size} bytes, its size says {n}"
        return ""

    def _claim(self, conn: socket.socket, pid: int, msg: Claim):
        with self._lock:
            entry = self._entries.get(msg.name)
            if entry is None:
                return Miss(name=msg.name)
            previous = entry.holding.served_by
            entry.lease, entry.holding.served_by = conn, pid
            entry.holding.handovers += 1
            reply = Claimed(holding=msgspec.structs.replace(entry.holding), key=entry.key,
                            manifest=entry.manifest, nfds=len(entry.fds))
            fds = list(entry.fds)
            # sent under the lock: a concurrent release cannot close them mid-send
            wire.send_msg(conn, reply)
            wire.send_fds(conn, fds)
        log.info("handed %s (%.2f GiB) to pid %d%s", msg.name, entry.holding.nbytes / 2**30, pid,
                 f" (pid {previous} still serves it too)" if previous and previous != pid else "")
        return None

    def _release(self, names, everything: bool, why: str) -> Released:
        with self._lock:
            chosen = list(self._entries) if everything else [n for n in names or () if n in self._entries]
            entries = [self._entries.pop(n) for n in chosen]
        for e in entries:
            e.close()
            log.info("released %s (%.2f GiB): %s", e.holding.name, e.holding.nbytes / 2**30, why)
        return Released(names=chosen, nbytes=sum(e.holding.nbytes for e in entries))

    def _prune(self, msg: Prune, pid: int) -> Released:
        keep = set(msg.keep)
        with self._lock:
            stale = [n for n, e in self._entries.items()
                     if e.holding.role == msg.role and e.holding.model == msg.model and n not in keep
                     and e.lease is None]
        return self._release(stale, False, why=f"no longer what pid {pid} serves for {msg.role} {msg.model}")


# ------------------------------------------------------------------------------------------------ client

# -------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightcache custodian",
                                description="Hold the caches of a socket directory (started by preload).")
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--detach", action="store_true", help="return once listening; serve from a child process")
    p.add_argument("--linger", type=float, default=LINGER_S)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [custodian] %(name)s: %(message)s")
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # it holds every block fd of a node
    except (ValueError, OSError):
        pass
    custodian = Custodian(custodian_socket_path(args.socket_dir), linger=args.linger)
    try:
        if not custodian.bind():
            log.info("a custodian already serves %s", custodian.socket_path)
            return 0
    except (OSError, WeightCacheError) as e:
        print(f"weightcache custodian: error: {e}", file=sys.stderr)
        return 1
    if args.detach and os.fork() > 0:
        os._exit(0)  # the listener is bound: clients can connect as soon as we return
    if args.detach:
        os.setsid()
    custodian.serve_forever()
    logging.shutdown()
    os._exit(0)
