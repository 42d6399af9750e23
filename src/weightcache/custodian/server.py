"""The custodian: one small long-lived process per socket directory (per node and user) that holds a duplicate
of every rank's block descriptors with its manifest and key, so a cache outlives its daemon.

A CUDA VMM POSIX fd (like a memfd) alone keeps its allocation alive, and a process that never mapped it can
pass it on. A daemon deposits its exported block fds, its key and its manifest once its weights are ready; a
replacement daemon for the same socket name (role, rank, device and key) claims them and serves again without
a load. The custodian never maps or imports anything and never imports torch.

Trust: a preload's supervisor registers a credential (a secret it hands its daemons alone); a deposit or claim
must carry a running preload's credential and come from a process that descends from that preload's
supervisor (SO_PEERCRED + /proc); a deposit's name must be its key's, its manifest must describe its blocks,
and every memfd must be sealed against writes, shrinking and growing and be as large as its block (checks.py).

Serving: each connection has a thread and its own deadlines (a frame once begun, a reply to be taken); nothing
is sent under a lock, so a client that stops reading is dropped without holding anyone else up. One log line
per refused request or bad frame, never a traceback.

Lifetime: it lives while it holds a cache or while anyone is connected. A cache whose preload is gone is freed
after that preload's lease (``--weight-cache-hold-after-exit``) unless the preload stopped asking to keep it;
`weightcache release`, SIGTERM or the socket's removal frees what it holds earlier.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .. import wire
from ..errors import DaemonUnavailable, ProtocolError, WeightCacheError
from ..server import UnixServer
from ..sockets import custodian_socket_path
from . import checks
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
    Holdings,
    Keep,
    Kept,
    ListHoldings,
    Miss,
    Prune,
    Register,
    Registered,
    Release,
    Released,
    Stop,
    Welcome,
    _decoder,
)
from .store import Entry, Store

log = logging.getLogger("weightcache.custodian.server")

LINGER_S = 2.0  # nothing held and no one connected for this long: exit
FIRST_CONTACT_S = 30.0  # a fresh custodian waits this long for its first client
HELLO_TIMEOUT_S = 5.0
FRAME_TIMEOUT_S = 10.0  # a frame, once begun (and a deposit's fds after it), must arrive within this
SEND_TIMEOUT_S = 5.0  # a client that takes no reply for this long is dropped
MAX_CLIENTS = 1024
TOKEN_CHARS = (32, 256)


class _Drop(Exception):
    """Answer with an error (if the peer still reads), log one line, close: the stream is out of step."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class _Gone(Exception):
    """Close without an answer (the peer stopped reading); log one line."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class Custodian:
    """The holder. `bind()` then `serve_forever()` (or `start()` for a background thread in tests)."""

    def __init__(self, socket_path: str | Path, *, linger: float = LINGER_S, first_contact: float = FIRST_CONTACT_S,
                 hello_timeout: float = HELLO_TIMEOUT_S, frame_timeout: float = FRAME_TIMEOUT_S,
                 send_timeout: float = SEND_TIMEOUT_S):
        self.socket_path = Path(socket_path)
        self.linger, self.first_contact = linger, first_contact
        self.hello_timeout, self.frame_timeout, self.send_timeout = hello_timeout, frame_timeout, send_timeout
        self.started_at = time.time()
        self.store = Store()
        self.server = UnixServer(self.socket_path, self._serve, self._refuse, what="custodian",
                                 max_clients=MAX_CLIENTS, max_per_peer=64, status_reserve=8)
        self._stop = threading.Event()
        self._signalled = False
        self._bound = False
        self._contacted = False  # a client said hello: the first-contact wait is over
        self._closed = False
        self._close_lock = threading.Lock()

    # -- lifecycle

    def bind(self) -> bool:
        """Listen on the socket; False if another live custodian already serves this directory."""
        self._bound = self.server.bind()
        return self._bound

    def start(self) -> None:
        """Serve in background threads (the listener must be bound)."""
        if not self._bound and not self.bind():
            raise CustodianError(f"a custodian already serves {self.socket_path}")
        self.server.start("custodian-accept")

    def serve_forever(self) -> None:
        """Serve until stopped, signalled, or idle (nothing held, no one connected); then release all. Frees
        the caches whose preload's lease ran out."""
        if threading.current_thread() is threading.main_thread():
            def flag(*_):
                self._signalled = True

            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, flag)
        self.start()
        log.info("custodian pid %d serving %s", os.getpid(), self.socket_path)
        contact_by = time.monotonic() + self.first_contact
        idle_since = time.monotonic()
        try:
            while not self._stop.wait(0.2):
                if self._signalled:
                    log.info("signal received: releasing every cache and exiting")
                    break
                if not self.server.path_is_ours():
                    log.warning("%s was removed or replaced: no one can reach this custodian; releasing every "
                                "cache and exiting", self.socket_path)
                    break
                self.sweep()
                if len(self.store) or self.server.connections:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.linger and (
                        self._contacted or time.monotonic() >= contact_by):
                    log.info("nothing held and no one connected: exiting")
                    break
        finally:
            self.close()

    def sweep(self) -> None:
        """Free the caches whose preload has been gone longer than its lease."""
        for e in self.store.expired():
            e.close()
            log.info("released %s (%s): its preload pid %d has been gone for %.0f s (its lease)", e.holding.name,
                     _gib(e.holding.nbytes), e.holding.preload, time.monotonic() - e.gone_since)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        entries = self.store.take(everything=True)
        for e in entries:
            e.close()
        if entries:
            log.info("released %d cache(s), %s", len(entries), _gib(sum(e.holding.nbytes for e in entries)))
        self.server.close()

    def holdings(self):
        return self.store.holdings()

    # -- one connection

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        self._answer_quietly(conn, Error(code=code, message=message))
        conn.close()

    def _answer_quietly(self, conn: socket.socket, msg) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            wire.send_msg(conn, msg)

    def _serve(self, conn: socket.socket, peer: tuple[int, int], status_only: bool) -> None:
        pid = peer[1]
        try:
            self._converse(conn, pid, status_only)
        except _Drop as e:
            log.warning("pid %d: %s; connection closed", pid, e)
            self._answer_quietly(conn, Error(code=e.code, message=str(e)))
        except _Gone as e:
            log.warning("pid %d: %s; connection closed", pid, e)
        except (EOFError, ConnectionError):
            pass
        except OSError as e:
            log.warning("pid %d: connection failed (%s); closed", pid, e.strerror or e)
        except Exception as e:  # a bug of ours: one line, the connection goes, the service stays
            log.error("pid %d: internal error (%s: %s); connection closed", pid, type(e).__name__, e)
        finally:
            self._dropped(conn, pid)

    def _converse(self, conn: socket.socket, pid: int, status_only: bool) -> None:
        try:
            hello = self._recv(conn, self.hello_timeout)
        except _Drop as e:
            raise _Drop(e.code, f"expected a hello: {e}") from None
        if not isinstance(hello, Hello):
            raise _Drop("protocol", f"expected a hello, got {type(hello).__name__}")
        if hello.protocol != PROTOCOL:
            raise _Drop("version", f"custodian protocol {hello.protocol} is not supported (this custodian, pid "
                                   f"{os.getpid()}, speaks {PROTOCOL})")
        self._contacted = True
        self._send(conn, Welcome(protocol=PROTOCOL, pid=os.getpid(), started_at=self.started_at))
        while not self._stop.is_set():
            if not self._readable(conn):
                continue
            msg = self._recv(conn, self.frame_timeout)
            if status_only and not isinstance(msg, ListHoldings):
                reply = Error(code="busy", message=f"the custodian serves {self.server.connections} connections; "
                                                   "this one may only list what is held")
            elif isinstance(msg, Stop):
                self._send(conn, self._release(None, everything=True, why=f"stop asked by pid {pid}"))
                self._stop.set()
                return
            else:
                reply = self._handle(conn, pid, msg)
            if reply is not None:
                self._send(conn, reply)

    def _readable(self, conn: socket.socket) -> bool:
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(500))

    def _recv(self, conn: socket.socket, within: float):
        """One frame, all of it within `within` seconds of its first byte. EOFError on a clean close."""
        try:
            return wire.recv_msg(conn, MAX_FRAME, time.monotonic() + within, _decoder)
        except ProtocolError as e:
            raise _Drop("protocol", f"bad frame: {e}") from None
        except TimeoutError:
            raise _Drop("protocol", f"a frame did not arrive whole within {within:.0f} s") from None

    def _send(self, conn: socket.socket, msg, fds: list[int] = ()) -> None:
        try:
            conn.settimeout(self.send_timeout)
            wire.send_msg(conn, msg)
            if fds:
                wire.send_fds(conn, fds)
        except TimeoutError:
            raise _Gone(f"stopped reading: a {type(msg).__name__} reply waited {self.send_timeout:.0f} s") from None

    def _dropped(self, conn: socket.socket, pid: int) -> None:
        d = self.store.drop(conn)
        if self._stop.is_set():
            for e in d.freed:
                e.close()
            return
        for e in d.orphans:
            log.warning("daemon pid %d serving %s is gone; holding its %s for a replacement", pid, e.holding.name,
                        _gib(e.holding.nbytes))
        if d.preload is None:
            return
        for e in d.freed:
            e.close()
        if d.freed:
            log.info("preload pid %d is gone: released its %d cache(s) (%s) at once (its hold after exit is 0)",
                     d.preload.pid, len(d.freed), _gib(sum(e.holding.nbytes for e in d.freed)))
        if d.leased:
            log.info("preload pid %d is gone: its %d cache(s) (%s) stay held for %.0f s for its next start "
                     "(`weightcache release` frees them earlier)", d.preload.pid, len(d.leased),
                     _gib(sum(e.holding.nbytes for e in d.leased)), d.preload.hold_after_exit)

    # -- requests

    def _handle(self, conn: socket.socket, pid: int, msg):
        if isinstance(msg, Register):
            return self._register(conn, pid, msg)
        if isinstance(msg, Deposit):
            return self._deposit(conn, pid, msg)
        if isinstance(msg, Claim):
            return self._claim(conn, pid, msg)
        if isinstance(msg, Keep):
            return self._keep(pid, msg)
        if isinstance(msg, Release):
            return self._release(msg.names, msg.everything, why=f"release asked by pid {pid}")
        if isinstance(msg, Prune):
            return self._prune(msg, pid)
        if isinstance(msg, ListHoldings):
            return Holdings(pid=os.getpid(), started_at=self.started_at, holdings=self.store.holdings())
        log.warning("pid %d sent an unexpected %s; refused", pid, type(msg).__name__)
        return Error(code="bad_request", message=f"unexpected message {type(msg).__name__}")

    def _refused(self, what: str, pid: int, why: str) -> Error:
        log.warning("refused %s from pid %d: %s", what, pid, why)
        return Error(code="refused", message=why)

    def _register(self, conn: socket.socket, pid: int, msg: Register):
        if not TOKEN_CHARS[0] <= len(msg.token) <= TOKEN_CHARS[1]:
            return self._refused("a registration", pid, f"a credential has {TOKEN_CHARS[0]} to {TOKEN_CHARS[1]} "
                                                        f"characters, not {len(msg.token)}")
        if not (math.isfinite(msg.hold_after_exit) and msg.hold_after_exit >= 0):
            return self._refused("a registration", pid, f"hold after exit must be a finite number of seconds >= 0, "
                                                        f"not {msg.hold_after_exit}")
        got = self.store.register(conn, pid, msg.token, msg.hold_after_exit)
        if isinstance(got, str):
            return self._refused("a registration", pid, got)
        log.info("preload pid %d registered (its caches stay held %.0f s after it is gone)%s", pid,
                 msg.hold_after_exit, f"; holding {len(got)} cache(s) for it already" if got else "")
        return Registered(owned=got)

    def _trust(self, pid: int, token: str) -> str:
        """"" when `pid` is a process of the running preload whose credential `token` is; else why not."""
        p = self.store.preload_for(token)
        if p is None:
            return "it carries no credential of a running preload (only a preload's daemons may deposit or claim)"
        if not checks.descends_from(pid, p.pid):
            return f"pid {pid} is not a process of the preload (pid {p.pid}) whose credential it carries"
        return ""

    def _deposit(self, conn: socket.socket, pid: int, msg: Deposit):
        h = msg.holding
        if not 0 < msg.nfds <= MAX_BLOCKS:
            raise _Drop("bad_request", f"a cache needs 1 to {MAX_BLOCKS} blocks, not {msg.nfds}")
        conn.settimeout(self.frame_timeout)
        try:  # after the frame, whatever we answer: the stream stays in step
            fds = wire.recv_fds(conn, msg.nfds)
        except (ProtocolError, DaemonUnavailable) as e:
            raise _Drop("protocol", f"deposit of {h.name!r}: {e}") from None
        except TimeoutError:
            raise _Drop("protocol", f"deposit of {h.name!r}: its {msg.nfds} block fd(s) did not follow within "
                                    f"{self.frame_timeout:.0f} s") from None
        problem = (self._trust(pid, msg.token) or checks.identity_problem(h, msg.key, msg.manifest)
                   or checks.blocks_problem(h, fds))
        old = None
        if not problem:
            h.deposited_at, h.deposited_by, h.served_by, h.handovers = time.time(), pid, pid, 0
            h.preload, h.kept, h.expires_in = self.store.preload_for(msg.token).pid, False, None
            old, problem = self.store.put(Entry(h, msg.key, msg.manifest, fds, owner=msg.token), conn)
        if problem:
            for fd in fds:
                os.close(fd)
            return self._refused(f"a deposit of {h.name!r}", pid, problem)
        if old is not None:
            old.close()
        log.info("holding %s (%s rank %d of %s, %s in %d block(s) on %s) for pid %d of preload pid %d", h.name,
                 h.role, h.rank, h.model, _gib(h.nbytes), len(fds), h.device, pid, h.preload)
        return Held(holding=h, replaced=old is not None)

    def _claim(self, conn: socket.socket, pid: int, msg: Claim):
        problem = self._trust(pid, msg.token)
        if problem:
            return self._refused(f"a claim of {msg.name!r}", pid, problem)
        try:
            lent = self.store.lend(msg.name)
        except OSError as e:
            return Error(code="busy", message=f"cannot hand {msg.name} over now: {e.strerror}")
        if lent is None:
            return Miss(name=msg.name)
        entry, holding, fds = lent
        try:
            self._send(conn, Claimed(holding=holding, key=entry.key, manifest=entry.manifest, nfds=len(fds)), fds)
        finally:
            for fd in fds:
                os.close(fd)
        previous = self.store.claimed(entry, conn, pid, msg.token)
        log.info("handed %s (%s) to pid %d%s", msg.name, _gib(holding.nbytes), pid,
                 f" (pid {previous} still serves it too)" if previous and previous != pid else "")
        return None

    def _keep(self, pid: int, msg: Keep):
        problem = self._trust(pid, msg.token)
        if problem:
            return self._refused("a keep", pid, problem)
        kept = self.store.keep(msg.names, msg.token)
        if kept:
            log.info("keeping %d cache(s) of preload pid %d until they are released: %s", len(kept), pid,
                     ", ".join(kept))
        return Kept(names=kept)

    def _release(self, names, everything: bool, why: str) -> Released:
        entries = self.store.take(names, everything=everything)
        for e in entries:
            e.close()
            log.info("released %s (%s): %s", e.holding.name, _gib(e.holding.nbytes), why)
        return Released(names=[e.holding.name for e in entries], nbytes=sum(e.holding.nbytes for e in entries))

    def _prune(self, msg: Prune, pid: int) -> Released:
        stale = self.store.stale(msg.role, msg.model, msg.keep, msg.token)
        return self._release(stale, False, why=f"no longer what pid {pid} serves for {msg.role} {msg.model}")


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
    ready_w = -1
    if args.detach:  # serve from a child in a session of its own; return once it listens (or could not)
        ready_r, ready_w = os.pipe()
        if os.fork() > 0:
            os.close(ready_w)
            said = os.read(ready_r, 1)
            os._exit(0 if said == b"1" else 1)
        os.close(ready_r)
        os.setsid()
    custodian = Custodian(custodian_socket_path(args.socket_dir), linger=args.linger)
    try:  # bound and listening in the serving process: SO_PEERCRED then names it to clients
        bound = custodian.bind()
    except (OSError, WeightCacheError) as e:
        print(f"weightcache custodian: error: {e}", file=sys.stderr)
        return 1
    if ready_w >= 0:
        os.write(ready_w, b"1")
        os.close(ready_w)
    if not bound:
        log.info("a custodian already serves %s", custodian.socket_path)
        return 0
    custodian.serve_forever()
    logging.shutdown()
    os._exit(0)
