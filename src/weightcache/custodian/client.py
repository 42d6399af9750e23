"""Talking to the custodian: a synchronous connection with deadlines, and starting one where none runs.

A custodian that accepts but does not answer (stopped, stuck) is reported as such (CustodianUnresponsive, with
its pid and whether it is stopped), never taken for "none runs": what it holds is unknown, not nothing."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import wire
from ..errors import DaemonUnavailable, PermissionDenied, ProtocolError
from ..sockets import custodian_socket_path, ensure_private_dir
from .messages import (
    MAX_FRAME,
    PROTOCOL,
    Claim,
    Claimed,
    CustodianError,
    CustodianUnresponsive,
    Deposit,
    Error,
    Held,
    Hello,
    Holding,
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

LOG_NAME = "custodian.log"  # in the socket directory: what a detached custodian says
CONNECT_TIMEOUT_S = 5.0  # to connect and be welcomed
REQUEST_TIMEOUT_S = 10.0
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("T": stopped); "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return ""


def unresponsive(path: Path, pid: int, waited: float) -> CustodianUnresponsive:
    """The one-line error for a custodian that does not answer."""
    who = f"the custodian (pid {pid}) at {path}" if pid else f"the custodian at {path}"
    if pid and process_state(pid) in ("T", "t"):
        how = (f"is stopped and does not answer: resume it (kill -CONT {pid}) or end it (kill -KILL {pid}, which "
               "frees what it holds)")
    else:
        how = f"did not answer within {waited:.0f} s"
    return CustodianUnresponsive(f"{who} {how}; what it holds is unknown", pid)


class CustodianClient:
    """A connection to the custodian. Requests are synchronous, each with a deadline; one that times out
    closes the connection (a late answer would put the stream out of step). A daemon's connection also marks
    the caches it deposited or claimed as served (until it closes); a supervisor's, its preload as running."""

    def __init__(self, sock: socket.socket, welcome: Welcome, path: Path):
        self._sock: socket.socket | None = sock
        self.pid, self.started_at, self.path = welcome.pid, welcome.started_at, path
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, path: str | Path, *, client: str = "", timeout: float = CONNECT_TIMEOUT_S) -> CustodianClient:
        path = Path(path)
        if path.is_dir():
            path = custodian_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        t0 = time.monotonic()
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonUnavailable(f"no custodian at {path}") from None
        except PermissionError:
            sock.close()
            raise PermissionDenied(f"not allowed to connect to the custodian at {path}") from None
        except TimeoutError:  # its backlog is full: it has not accepted anyone for a while
            sock.close()
            raise unresponsive(path, 0, timeout) from None
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to the custodian at {path}: {e.strerror or e}") from None
        try:
            pid = wire.peer_credentials(sock)[0]  # the listener's, whether or not it answers
        except OSError:
            pid = 0
        try:
            try:
                wire.send_msg(sock, Hello(protocol=PROTOCOL, client=client or f"pid {os.getpid()}"))
            except OSError:
                pass  # it may have refused us already (uid): its reason waits in our receive buffer
            reply = cls._recv(sock, path, max(0.1, timeout - (time.monotonic() - t0)), pid)
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"custodian at {path}: expected a welcome, got {type(reply).__name__}")
        except BaseException:
            sock.close()
            raise
        return cls(sock, reply, path)

    @staticmethod
    def _recv(sock: socket.socket, path: Path, timeout: float, pid: int = 0):
        try:
            reply = wire.recv_msg(sock, MAX_FRAME, time.monotonic() + timeout, _decoder)
        except EOFError:
            raise DaemonUnavailable(f"the custodian at {path} closed the connection") from None
        except TimeoutError:
            raise unresponsive(path, pid, timeout) from None
        except OSError as e:
            raise DaemonUnavailable(f"the custodian at {path} is gone: {e.strerror or e}") from None
        if isinstance(reply, Error):
            if reply.code == "permission":
                raise PermissionDenied(f"custodian at {path}: {reply.message}")
            if reply.code in ("protocol", "version"):
                raise ProtocolError(f"custodian at {path}: {reply.message}")
            raise CustodianError(f"custodian at {path} refused: {reply.message}")
        return reply

    def _request(self, msg, fds: list[int] = (), timeout: float = REQUEST_TIMEOUT_S):
        with self._lock:
            if self._sock is None:
                raise DaemonUnavailable("the custodian connection is closed")
            sock = self._sock
            try:
                sock.settimeout(timeout)
                wire.send_msg(sock, msg)
                if fds:
                    wire.send_fds(sock, list(fds))
                reply = self._recv(sock, self.path, timeout, self.pid)
                if isinstance(reply, Claimed):
                    sock.settimeout(timeout)
                    return reply, wire.recv_fds(sock, reply.nfds)
                return reply, []
            except CustodianUnresponsive:
                self._close_locked()
                raise
            except TimeoutError:
                self._close_locked()
                raise unresponsive(self.path, self.pid, timeout) from None
            except OSError as e:
                self._close_locked()
                raise DaemonUnavailable(f"the custodian at {self.path} is gone: {e.strerror or e}") from None

    def _expect(self, reply, cls):
        if not isinstance(reply, cls):
            raise ProtocolError(f"custodian at {self.path}: expected {cls.__name__}, got {type(reply).__name__}")
        return reply

    def register(self, token: str, hold_after_exit: float) -> Registered:
        """Stand for a running preload: deposits and claims that carry `token` are of its daemons."""
        reply, _ = self._request(Register(token=token, hold_after_exit=hold_after_exit))
        return self._expect(reply, Registered)

    def deposit(self, holding: Holding, key: bytes, manifest: bytes, fds: list[int], token: str = "") -> Held:
        reply, _ = self._request(Deposit(holding=holding, key=key, manifest=manifest, nfds=len(fds), token=token),
                                 fds)
        return self._expect(reply, Held)

    def claim(self, name: str, token: str = "") -> tuple[Claimed, list[int]] | None:
        """The held cache `name` and its block fds (ours to close), or None."""
        reply, fds = self._request(Claim(name=name, token=token))
        if isinstance(reply, Miss):
            return None
        return self._expect(reply, Claimed), fds

    def keep(self, names: list[str], token: str) -> Kept:
        reply, _ = self._request(Keep(names=list(names), token=token))
        return self._expect(reply, Kept)

    def release(self, names: list[str] = (), everything: bool = False) -> Released:
        reply, _ = self._request(Release(names=list(names), everything=everything))
        return self._expect(reply, Released)

    def prune(self, role: str, model: str, keep: list[str], token: str = "") -> Released:
        reply, _ = self._request(Prune(role=role, model=model, keep=list(keep), token=token))
        return self._expect(reply, Released)

    def holdings(self, timeout: float = REQUEST_TIMEOUT_S) -> Holdings:
        reply, _ = self._request(ListHoldings(), timeout=timeout)
        return self._expect(reply, Holdings)

    def stop(self) -> Released:
        reply, _ = self._request(Stop())
        return self._expect(reply, Released)

    def lost(self) -> bool:
        """True once the custodian closed our connection (it died or was stopped); never blocks."""
        with self._lock:
            if self._sock is None:
                return True
            try:
                poller = select.poll()
                poller.register(self._sock, select.POLLIN | _POLLRDHUP)
                events = poller.poll(0)
                if not events:
                    return False
                if events[0][1] & (_POLLRDHUP | select.POLLHUP | select.POLLERR):
                    return True  # closed, even behind a last answer we never read
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

    def fileno(self) -> int:
        """The connection's descriptor (-1 once closed), to wait on."""
        sock = self._sock
        return sock.fileno() if sock is not None else -1

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


def launch(socket_dir: str | Path, timeout: float = 60.0) -> None:
    """Start a custodian for `socket_dir` in its own session (not a child of ours: it must outlive us)."""
    socket_dir = ensure_private_dir(socket_dir)
    with open(socket_dir / LOG_NAME, "ab") as logf:
        proc = subprocess.run(
            [sys.executable, "-m", "weightcache.cli", "custodian", "--socket-dir", str(socket_dir), "--detach"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True, timeout=timeout,
            close_fds=True)
    if proc.returncode != 0:
        raise CustodianError(f"the custodian for {socket_dir} did not start (exit code {proc.returncode}); see "
                             f"{socket_dir / LOG_NAME}")


def connect_or_launch(socket_dir: str | Path, *, client: str = "",
                      timeout: float = CONNECT_TIMEOUT_S) -> CustodianClient:
    """A connection to the custodian of `socket_dir`, starting one if none runs. One that does not answer is
    an error (CustodianUnresponsive), never replaced: it may hold every cache of the directory."""
    path = custodian_socket_path(socket_dir)
    try:
        return CustodianClient.connect(path, client=client, timeout=timeout)
    except DaemonUnavailable:
        pass
    try:
        launch(socket_dir)
    except CustodianError:
        try:  # another preload may have started one at the same moment
            return CustodianClient.connect(path, client=client, timeout=timeout)
        except DaemonUnavailable:
            pass
        raise
    return CustodianClient.connect(path, client=client, timeout=timeout)
