"""Serving a Unix socket, shared by the daemon and the custodian: bind in a private directory, accept
without ever stopping, admit by the peer's uid (SO_PEERCRED), by count and per process, and give each
admitted connection a thread of its own. A client is never left waiting in the listen backlog: connections
take at most half of the descriptors the process has left at bind, and when descriptors run out all the
same, a spare one kept for that moment accepts the next client to tell it "busy" at once."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from . import wire
from .sockets import check_socket_path, ensure_private_dir, take_over_path

log = logging.getLogger("weightcache.server")

ACCEPT_QUIET = 2.0  # seconds without an accept error that end an episode of them
FD_SHARE = 2  # connections may hold 1/FD_SHARE of the descriptors left at bind (blocks and attaches need the rest)
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# handler(conn, (uid, pid), status_only); refuse(conn, code, message)
Handler = Callable[[socket.socket, tuple[int, int], bool], None]
Refuse = Callable[[socket.socket, str, str], None]


class UnixServer:
    """Connections to one socket path. ``max_clients`` at once, ``max_per_peer`` from one process; past
    ``max_clients`` a further ``status_reserve`` are admitted with ``status_only`` (so that `status` works
    through a flood). A peer whose uid is not allowed is refused ("permission")."""

    def __init__(self, path: str | Path, handler: Handler, refuse: Refuse, *, what: str = "daemon",
                 allowed_uids: Iterable[int] = (), max_clients: int = 256, max_per_peer: int = 64,
                 status_reserve: int = 8):
        self.path = Path(path)
        self.what = what
        self.handler, self.refuse = handler, refuse
        self.allowed_uids = {os.getuid(), *allowed_uids}
        self.max_clients, self.max_per_peer, self.status_reserve = max_clients, max_per_peer, status_reserve
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()
        self._per_peer: dict[tuple[int, int], int] = {}  # (uid, pid) -> open connections
        self._inode = 0
        self._spare: int | None = None  # a descriptor kept free to refuse clients when none is left

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def bind(self) -> bool:
        """Listen at the path (a stale socket there is replaced, a live one refused: SocketInUse). For a
        custodian, False where a live one already serves the path."""
        check_socket_path(self.path)
        ensure_private_dir(self.path.parent)
        if not take_over_path(self.path, self.what):
            return False
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o666 if len(self.allowed_uids) > 1 else 0o600)
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        listener.settimeout(0.2)
        self._listener = listener
        self._inode = os.stat(self.path).st_ino
        self._fit_descriptors()
        self._spare = _open_spare()
        return True

    def _fit_descriptors(self) -> None:
        """Lower max_clients and status_reserve to what RLIMIT_NOFILE leaves room for (see FD_SHARE)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:
            return
        if soft == resource.RLIM_INFINITY:
            return
        room = max(2, (soft - used) // FD_SHARE)
        if room >= self.max_clients + self.status_reserve:
            return
        self.status_reserve = min(self.status_reserve, room // 2)
        self.max_clients = room - self.status_reserve
        log.warning("%s: %d of its %d descriptors are in use: at most %d connections (+%d for status); raise "
                    "ulimit -n for more", self.what, used, soft, self.max_clients, self.status_reserve)

    def _refuse_with_spare(self, listener: socket.socket) -> bool:
        """Out of descriptors: free the spare one, accept the next waiting client and tell it "busy" (rather
        than leave it in the backlog until its timeout), then take the spare back. True if one was told."""
        spare, self._spare = self._spare, None
        if spare is None:
            self._spare = _open_spare()  # once a descriptor is free again
            return False
        os.close(spare)
        try:
            conn, _ = listener.accept()
        except OSError:
            conn = None
        if conn is not None:
            self.refuse(conn, "busy", f"{self.what} is out of file descriptors ({self.connections} connections "
                                      "open); retry later")
        self._spare = _open_spare()
        return conn is not None

    def start(self, name: str = "weightcache-accept") -> None:
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()

    def path_is_ours(self) -> bool:
        """False once the socket file was removed or replaced (no one can reach us there any more)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def close(self) -> None:
        """Stop accepting, remove the socket file (if still ours) and shut every open connection down."""
        self._stop.set()
        listener, self._listener = self._listener, None
        spare, self._spare = self._spare, None
        if spare is not None:
            os.close(spare)
        if listener is not None:
            listener.close()
            if self.path_is_ours():
                try:
                    self.path.unlink()
                except OSError:
                    pass
        with self._lock:
            conns = list(self._connections)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

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
                    hint = " (out of file descriptors)" if e.errno in OUT_OF_DESCRIPTORS else ""
                    log.warning("%s cannot accept connections%s: %s; %d connection(s) open; clients are told it "
                                "is busy until it can", self.what, hint, e.strerror or e, self.connections)
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_with_spare(listener):
                    continue
                backoff = min(max(2 * backoff, 0.01), 1.0)
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            if trouble_since is not None and time.monotonic() - last_error > ACCEPT_QUIET:
                log.warning("%s accepts connections again (for %.1f s it could not)", self.what,
                            last_error - trouble_since)
                trouble_since = None
            try:
                self._admit(conn)
            except Exception:  # noqa: BLE001 - the loop must outlive any one client
                log.exception("%s: error while admitting a connection", self.what)
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = wire.peer_credentials(conn)
        except OSError:
            conn.close()
            return
        if uid not in self.allowed_uids:
            log.warning("refused pid %d: uid %d not allowed", pid, uid)
            self.refuse(conn, "permission", f"uid {uid} is not allowed here (allowed: {sorted(self.allowed_uids)})")
            return
        peer = (uid, pid)
        with self._lock:
            total, mine = len(self._connections), self._per_peer.get(peer, 0)
            full = total >= self.max_clients + self.status_reserve
            if not full and mine < self.max_per_peer:
                self._connections.add(conn)
                self._per_peer[peer] = mine + 1
        if full:
            self.refuse(conn, "busy", f"{self.what} serves {total} connections already; retry later")
        elif mine >= self.max_per_peer:
            self.refuse(conn, "busy", f"process {pid} holds {mine} connections already (at most "
                                      f"{self.max_per_peer}); close some or retry later")
        else:
            try:
                threading.Thread(target=self._serve, args=(conn, peer, total >= self.max_clients),
                                 name=f"{self.what}-conn", daemon=True).start()
            except RuntimeError as e:  # can't start new thread (RLIMIT_NPROC, memory)
                self._forget(conn, peer)
                self.refuse(conn, "busy", f"{self.what} cannot start a thread for this connection ({e}); "
                                          "retry later")

    def _serve(self, conn: socket.socket, peer: tuple[int, int], status_only: bool) -> None:
        try:
            self.handler(conn, peer, status_only)
        except OSError:
            pass  # the peer vanished; nothing of ours is lost
        except Exception:
            log.exception("error while serving pid %d", peer[1])
        finally:
            self._forget(conn, peer)
            conn.close()

    def _forget(self, conn: socket.socket, peer: tuple[int, int]) -> None:
        with self._lock:
            self._connections.discard(conn)
            left = self._per_peer.get(peer, 1) - 1
            if left > 0:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
