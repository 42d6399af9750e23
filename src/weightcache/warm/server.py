"""The warm engine interpreter: a long-lived process that imported torch, vLLM and transformers (no CUDA
context) and forks a child per request that becomes the engine (engine.py), with the caller's argv,
environment, cwd and fds.

One thread, one poll loop: the listener, each engine's pidfd (readable when it exits: reaped, its status
sent to its client), each client's connection (closed: the client died, so its engine's process group gets
SIGTERM, then SIGKILL after a grace). Requests are short and answered at once. SIGTERM/SIGINT or `Retire`:
stop accepting, remove the socket, exit once the running engines have exited.

The caller's uid is checked with SO_PEERCRED; messages are typed (messages.py) in wire's framing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .. import __version__, wire
from ..errors import ProtocolError, WeightCacheError
from ..sockets import ensure_private_dir, take_over_path
from . import command as commands
from .engine import Forked
from .identity import Identity, shadowed, startup_modules
from .messages import (
    MAX_FDS,
    MAX_REQUEST,
    PROTOCOL,
    Accepted,
    Check,
    Exited,
    Job,
    Query,
    Refused,
    Retire,
    Retiring,
    Run,
    Started,
    Status,
    request_decoder,
)

log = logging.getLogger("weightcache.warm.server")

REQUEST_TIMEOUT_S = 5.0
KILL_GRACE_S = 5.0
_FD_FLOOR = 64  # the server's own fds live above the numbers engines usually get


@dataclasses.dataclass
class _Job:
    pid: int
    pidfd: int
    conn: socket.socket | None
    client_pid: int
    argv: list[str]
    started_at: float = dataclasses.field(default_factory=time.time)
    kill_at: float = 0.0  # SIGKILL the group then (its client died)


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _high(fd: int) -> int:
    """Move one of our fds above the numbers engines get (close-on-exec; the old number is closed)."""
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _FD_FLOOR)
    os.close(fd)
    return new


def _high_socket(sock: socket.socket) -> socket.socket:
    new = socket.socket(sock.family, sock.type, fileno=_high(sock.detach()))
    return new


class WarmServer:
    def __init__(self, socket_path: str | Path, identity: Identity, *, kill_grace: float = KILL_GRACE_S,
                 launcher: str = "", learner=None):
        self.socket_path = Path(socket_path)
        self.identity = identity
        self.kill_grace = kill_grace
        self.launcher = launcher
        self.learner = learner  # learned.Learner: imports what engines recorded (None: engines record nothing)
        self.pid = os.getpid()
        self.started_at = time.time()
        self.flags = commands.fixed_flags_of(list(getattr(sys, "orig_argv", [sys.executable])))
        self.startup = startup_modules()
        self.jobs: dict[int, _Job] = {}  # pid -> job
        self.started = self.refused = 0
        self.retiring = False
        self._listener: socket.socket | None = None
        self._inode = 0
        self._poll = select.poll()
        self._by_fd: dict[int, tuple[str, object]] = {}
        self._wake_r = self._wake_w = -1
        self._signalled = False

    # -- lifecycle

    def bind(self) -> bool:
        """Listen; False if a live warm interpreter already serves this path (a stale socket is replaced)."""
        ensure_private_dir(self.socket_path.parent)
        if not take_over_path(self.socket_path, "custodian"):  # "custodian": a live one is left alone
            return False
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        self._listener = _high_socket(listener)
        self._inode = os.stat(self.socket_path).st_ino
        self._watch(self._listener.fileno(), "listener", None)
        return True

    def _watch(self, fd: int, kind: str, obj) -> None:
        self._by_fd[fd] = (kind, obj)
        self._poll.register(fd, select.POLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._by_fd.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poll.unregister(fd)

    def serve(self) -> Forked | None:
        """Serve until retired and idle (None), or return in a forked child (its Forked)."""
        if self._listener is None:
            raise WeightCacheError("bind() first")
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r, self._wake_w = _high(r), _high(w)
        self._watch(self._wake_r, "wake", None)
        old_wakeup = signal.set_wakeup_fd(self._wake_w)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        last_check = time.monotonic()
        while True:
            if self._signalled and not self.retiring:
                log.info("signal received: no new engines; exiting once %d running one(s) exit", len(self.jobs))
                self.retire()
            if self.retiring and not self.jobs:
                break
            for fd, _ in self._poll.poll(self._timeout_ms()):
                kind, obj = self._by_fd.get(fd, ("gone", None))
                if kind == "listener":
                    forked = self._accept()
                    if forked is not None:
                        return self._become_child(forked, handlers, old_wakeup)
                elif kind == "wake":
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 512)
                elif kind in ("pidfd", "client"):
                    try:
                        (self._reap if kind == "pidfd" else self._client_event)(obj)
                    except Exception:  # one engine's trouble must not end the service
                        log.exception("while handling engine pid %d", obj.pid)
            self._kill_overdue()
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if not self.retiring and not self._socket_is_ours():
                    log.warning("%s was removed or replaced: no one can reach this warm interpreter; retiring",
                                self.socket_path)
                    self.retire()
                if not self.retiring and self.learner is not None and self.learner.changed():
                    if not self.learner.learn():
                        self.retire()
        signal.set_wakeup_fd(old_wakeup)
        for s, h in handlers.items():
            signal.signal(s, h)
        self.close()
        return None

    def _on_signal(self, *_):
        self._signalled = True

    def _timeout_ms(self) -> int:
        due = [j.kill_at for j in self.jobs.values() if j.kill_at]
        if not due:
            return 1000
        return max(0, min(1000, int((min(due) - time.monotonic()) * 1000) + 1))

    def _socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self._inode
        except OSError:
            return False

    def retire(self) -> None:
        if self.retiring:
            return
        self.retiring = True
        if self._listener is not None:
            self._unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if self._socket_is_ours():
                with contextlib.suppress(OSError):
                    self.socket_path.unlink()

    def close(self) -> None:
        self.retire()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    def status(self) -> Status:
        ident = self.identity
        return Status(pid=os.getpid(), started_at=self.started_at, import_seconds=ident.import_seconds,
                      python=ident.python, executable=ident.executable, prefix=ident.prefix, weightcache=__version__,
                      modules=ident.stamps(), env_names=ident.env_names(),
                      jobs=[Job(pid=j.pid, client_pid=j.client_pid, argv=j.argv, started_at=j.started_at)
                            for j in self.jobs.values()],
                      started=self.started, refused=self.refused, retiring=self.retiring)

    # -- requests

    def _accept(self) -> Forked | None:
        try:
            conn, _ = self._listener.accept()
        except OSError as e:
            log.warning("accept failed: %s", e)
            time.sleep(0.05)  # fd exhaustion must not spin
            return None
        conn = _high_socket(conn)
        fds: list[int] = []
        keep = False
        try:
            pid, uid, _ = wire.peer_credentials(conn)
            if uid != os.getuid():
                log.warning("refused pid %d: uid %d is not ours", pid, uid)
                self._reply(conn, Refused(code="permission", message=f"uid {uid} may not use the warm engine "
                                                                     f"interpreter of uid {os.getuid()}"))
                return None
            try:
                msg = wire.recv_msg(conn, MAX_REQUEST, time.monotonic() + REQUEST_TIMEOUT_S, request_decoder)
            except (EOFError, TimeoutError, ProtocolError, OSError) as e:
                self._reply(conn, Refused(code="protocol", message=f"expected a request: {e}"))
                return None
            if msg.protocol != PROTOCOL:
                self._reply(conn, Refused(code="version", message=f"warm protocol {msg.protocol} is not supported "
                                                                  f"(this warm interpreter speaks {PROTOCOL})"))
                return None
            if isinstance(msg, Query):
                self._reply(conn, self.status())
            elif isinstance(msg, Retire):
                log.info("retire asked by pid %d: no new engines; exiting once %d running one(s) exit", pid,
                         len(self.jobs))
                self.retire()
                self._reply(conn, Retiring(jobs=len(self.jobs)))
            elif isinstance(msg, Check):
                refusal = self.identity.check(protocol_ok=True, weightcache=msg.weightcache,
                                              interpreter=msg.interpreter, env=msg.env)
                self._reply(conn, refusal or Accepted(server_pid=os.getpid()))
            elif isinstance(msg, Run):
                if not 0 <= len(msg.fds) <= MAX_FDS or len(set(msg.fds)) != len(msg.fds) or min(msg.fds, default=0) < 0:
                    self._reply(conn, Refused(code="protocol", message=f"bad fd list {msg.fds[:8]}"))
                    return None
                if msg.fds:
                    conn.settimeout(REQUEST_TIMEOUT_S)
                    fds = wire.recv_fds(conn, len(msg.fds))
                    fds = [_high(fd) for fd in fds]
                forked, keep = self._run(conn, pid, msg, fds)
                if forked is not None:
                    return forked
        except (OSError, WeightCacheError) as e:
            log.warning("request from a client failed: %s", e)
        except Exception:
            log.exception("internal error while serving a request")
        finally:
            if os.getpid() == self.pid:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if not keep:
                    conn.close()
        return None

    def _reply(self, conn: socket.socket, msg) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            wire.send_msg(conn, msg)

    def _refusal(self, msg: Run) -> tuple[Refused | None, commands.PythonCommand | None]:
        try:
            cmd = commands.resolve(msg.argv, msg.env, msg.cwd)
        except commands.NotPython as e:
            return Refused(code="command", message=str(e)), None
        if os.path.abspath(cmd.interpreter) != os.path.abspath(msg.interpreter):
            return Refused(code="command", message=f"the client found {msg.interpreter}, the server "
                                                   f"{cmd.interpreter}"), None
        refusal = self.identity.check(protocol_ok=True, weightcache=msg.weightcache, interpreter=cmd.interpreter,
                                      env=msg.env, flags=cmd.fixed_flags, server_flags=self.flags)
        if refusal is None:
            why = shadowed(cmd, msg.cwd, self.startup)
            if why:
                refusal = Refused(code="modules", message=why)
        if refusal is None and cuda_initialized():
            refusal = Refused(code="cuda", message="this warm interpreter holds a CUDA context: it cannot fork an "
                                                   "engine (restart it)")
        return refusal, cmd

    def _run(self, conn: socket.socket, client_pid: int, msg: Run, fds: list[int]) -> tuple[Forked | None, bool]:
        """Fork the engine. Returns (Forked, _) in the child; (None, keep the connection) in the server."""
        refusal, cmd = self._refusal(msg)
        if refusal is not None:
            self.refused += 1
            log.info("refused pid %d (%s): %s", client_pid, refusal.code, refusal.message)
            self._reply(conn, refusal)
            return None, False
        if threading.active_count() > 1:
            log.warning("%d Python threads run in the warm interpreter: only this one survives the fork",
                        threading.active_count())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # nothing of ours may reach the engine's stdout
        try:
            pid = os.fork()
        except OSError as e:
            self._reply(conn, Refused(code="internal", message=f"fork failed: {e.strerror or e}"))
            return None, False
        if pid == 0:
            conn.close()
            learn_dir = str(self.learner.dir) if self.learner is not None else ""
            return Forked(run=msg, command=cmd, fds=fds, launcher=self.launcher if msg.spawn else "",
                          learn_dir=learn_dir), False
        self.started += 1
        pidfd = _high(os.pidfd_open(pid))
        job = _Job(pid=pid, pidfd=pidfd, conn=conn, client_pid=client_pid, argv=list(msg.argv))
        self.jobs[pid] = job
        self._watch(pidfd, "pidfd", job)
        log.info("engine pid %d for client pid %d: %s", pid, client_pid, " ".join(msg.argv)[:200])
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            wire.send_msg(conn, Started(pid=pid, server_pid=os.getpid()))
            wire.send_fds(conn, [pidfd])
        except OSError:
            self._client_gone(job)
            return None, False
        conn.setblocking(False)
        self._watch(conn.fileno(), "client", job)
        return None, True

    def _client_event(self, job: _Job) -> None:
        if job.conn is None:
            return
        try:
            data = job.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # nothing is expected from a client after its Run: EOF or garbage, it is gone
            self._client_gone(job)

    def _client_gone(self, job: _Job) -> None:
        if job.conn is not None:
            self._unwatch(job.conn.fileno())
            job.conn.close()
            job.conn = None
        if job.pid in self.jobs and not job.kill_at:
            log.warning("client pid %d of engine pid %d is gone: stopping the engine (SIGTERM, SIGKILL after "
                        "%.0f s)", job.client_pid, job.pid, self.kill_grace)
            _signal_group(job.pid, signal.SIGTERM)
            job.kill_at = time.monotonic() + self.kill_grace

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.kill_at and now >= job.kill_at:
                log.warning("engine pid %d outlived its grace: SIGKILL", job.pid)
                _signal_group(job.pid, signal.SIGKILL)
                job.kill_at = now + 3600  # once

    def _reap(self, job: _Job) -> None:
        try:
            wpid, status = os.waitpid(job.pid, os.WNOHANG)
        except ChildProcessError:
            wpid, status = job.pid, None
        if wpid == 0:
            return  # not exited yet
        self._unwatch(job.pidfd)
        os.close(job.pidfd)
        self.jobs.pop(job.pid, None)
        code = sig = None
        if status is not None:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
            else:
                code = os.waitstatus_to_exitcode(status)
        log.info("engine pid %d exited (%s)", job.pid, f"signal {sig}" if sig else f"code {code}")
        if job.conn is not None:
            with contextlib.suppress(OSError):
                job.conn.setblocking(True)
                job.conn.settimeout(1.0)
                wire.send_msg(job.conn, Exited(pid=job.pid, code=code, signal=sig))
            self._unwatch(job.conn.fileno())
            job.conn.close()
            job.conn = None

    # -- the child

    def _become_child(self, forked: Forked, handlers, old_wakeup) -> Forked:
        """In the forked child: drop everything of the server (its fds, its signal handlers)."""
        signal.set_wakeup_fd(-1)
        for s, h in handlers.items():
            signal.signal(s, h)
        for fd in list(self._by_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        for job in self.jobs.values():
            if job.conn is not None:
                with contextlib.suppress(OSError):
                    job.conn.detach()
        if self._listener is not None:
            self._listener.detach()
        with contextlib.suppress(OSError):
            os.close(self._wake_w)
        self._by_fd.clear()
        self.jobs.clear()
        return forked


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the engine leads its own session: its group holds what it started
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    except PermissionError:
        pass
