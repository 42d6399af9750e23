"""Talking to the custodian: a synchronous connection, and starting one where none runs."""

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

LOG_NAME = "custodian.log"  # in the socket directory: what a detached custodian says


class CustodianClient:
    """A connection to the custodian. Requests are synchronous; a daemon's connection also marks the caches
    it deposited or claimed as served (until it closes)."""

    def __init__(self, sock: socket.socket, welcome: Welcome, path: Path):
        self._sock: socket.socket | None = sock
        self.pid, self.started_at, self.path = welcome.pid, welcome.started_at, path
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, path: str | Path, *, client: str = "", timeout: float = 10.0) -> CustodianClient:
        path = Path(path)
        if path.is_dir():
            path = custodian_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonUnavailable(f"no custodian at {path}") from None
        except PermissionError:
            sock.close()
            raise PermissionDenied(f"not allowed to connect to the custodian at {path}") from None
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to the custodian at {path}: {e}") from None
        try:
            try:
                wire.send_msg(sock, Hello(protocol=PROTOCOL, client=client or f"pid {os.getpid()}"))
            except OSError:
                pass  # it may have refused us already (uid): its reason waits in our receive buffer
            reply = cls._recv(sock, path, timeout)
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"custodian at {path}: expected a welcome, got {type(reply).__name__}")
        except BaseException:
            sock.close()
            raise
        return cls(sock, reply, path)

    @staticmethod
    def _recv(sock: socket.socket, path: Path, timeout: float):
        try:
            reply = wire.recv_msg(sock, MAX_FRAME, time.monotonic() + timeout, _decoder)
        except EOFError:
            raise DaemonUnavailable(f"the custodian at {path} closed the connection") from None
        except (TimeoutError, OSError) as e:
            raise DaemonUnavailable(f"the custodian at {path} did not answer: {e}") from None
        if isinstance(reply, Error):
            if reply.code == "permission":
                raise PermissionDenied(f"custodian at {path}: {reply.message}")
            if reply.code in ("protocol", "version"):
                raise ProtocolError(f"custodian at {path}: {reply.message}")
            raise CustodianError(f"custodian at {path} refused: {reply.message}")
        return reply

    def _request(self, msg, fds: list[int] = (), timeout: float = 30.0):
        with self._lock:
            if self._sock is None:
                raise DaemonUnavailable("the custodian connection is closed")
            try:
                self._sock.settimeout(timeout)
                wire.send_msg(self._sock, msg)
                if fds:
                    wire.send_fds(self._sock, list(fds))
                reply = self._recv(self._sock, self.path, timeout)
                if isinstance(reply, Claimed):
                    return reply, wire.recv_fds(self._sock, reply.nfds)
                return reply, []
            except OSError as e:
                raise DaemonUnavailable(f"the custodian at {self.path} is gone: {e}") from None

    def _expect(self, reply, cls):
        if not isinstance(reply, cls):
            raise ProtocolError(f"custodian at {self.path}: expected {cls.__name__}, got {type(reply).__name__}")
        return reply

    def deposit(self, holding: Holding, key: bytes, manifest: bytes, fds: list[int]) -> Held:
        reply, _ = self._request(Deposit(holding=holding, key=key, manifest=manifest, nfds=len(fds)), fds)
        return self._expect(reply, Held)

    def claim(self, name: str) -> tuple[Claimed, list[int]] | None:
        """The held cache `name` and its block fds (ours to close), or None."""
        reply, fds = self._request(Claim(name=name))
        if isinstance(reply, Miss):
            return None
        return self._expect(reply, Claimed), fds

    def release(self, names: list[str] = (), everything: bool = False) -> Released:
        reply, _ = self._request(Release(names=list(names), everything=everything))
        return self._expect(reply, Released)

    def prune(self, role: str, model: str, keep: list[str]) -> Released:
        reply, _ = self._request(Prune(role=role, model=model, keep=list(keep)))
        return self._expect(reply, Released)

    def holdings(self) -> Holdings:
        reply, _ = self._request(ListHoldings())
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
                poller.register(self._sock, select.POLLIN)
                if not poller.poll(0):
                    return False
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


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


def connect_or_launch(socket_dir: str | Path, *, client: str = "") -> CustodianClient:
    """A connection to the custodian of `socket_dir`, starting one if none runs."""
    path = custodian_socket_path(socket_dir)
    try:
        return CustodianClient.connect(path, client=client)
    except DaemonUnavailable:
        pass
    try:
        launch(socket_dir)
    except CustodianError:
        try:  # another preload may have started one at the same moment
            return CustodianClient.connect(path, client=client)
        except DaemonUnavailable:
            pass
        raise
    return CustodianClient.connect(path, client=client)
