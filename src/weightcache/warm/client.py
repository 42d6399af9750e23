"""`weightcache run -- CMD ARGS...`: start an engine from the warm interpreter and stand in for it.

The client sends its argv, environment, cwd, umask, ignored signals and its stdin/stdout/stderr and other
inheritable fds (SCM_RIGHTS); it receives the engine's pid and a pidfd, forwards the signals it gets to the
engine (SIGTSTP as SIGSTOP: the engine's process group has no terminal), and exits as the engine exited (its
code, or killed by the same signal). The warm interpreter kills the engine if the client dies.

With no warm interpreter reachable, or one made for another interpreter, weightcache version or
environment, it says so in one line and execs the command itself: the same process, fds and signals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
from pathlib import Path

from .. import __version__, wire
from ..argv import option_value
from ..errors import ProtocolError, WeightCacheError
from ..sockets import default_socket_dir_path, warm_socket_path
from . import command as commands
from .messages import (
    MAX_FDS,
    MAX_REPLY,
    PROTOCOL,
    Accepted,
    Check,
    Exited,
    Query,
    Refused,
    Retire,
    Retiring,
    Run,
    Started,
    Status,
    WarmError,
    reply_decoder,
)

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGALRM, signal.SIGCONT, signal.SIGTSTP)
REPLY_TIMEOUT_S = 30.0
EXIT_STATUS_UNKNOWN = 255


class Unavailable(WarmError):
    """No usable warm interpreter: the reason is one line; the command then starts normally."""


# ------------------------------------------------------------------------------------------------ connection

def connect(path: str | Path, timeout: float = REPLY_TIMEOUT_S) -> socket.socket:
    """A connection to the warm interpreter at `path`, refusing a socket that is not ours."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Unavailable(f"no warm engine interpreter ({path} does not exist)") from None
    except OSError as e:
        raise Unavailable(f"cannot look at {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise Unavailable(f"{path} is not a socket; refusing it")
    if st.st_uid != os.getuid():
        raise Unavailable(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()}); refusing it")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        raise Unavailable(f"stale socket {path}: its warm engine interpreter is gone") from None
    except OSError as e:
        sock.close()
        raise Unavailable(f"cannot connect to {path}: {e.strerror or e}") from None
    _, uid, _ = wire.peer_credentials(sock)
    if uid != os.getuid():
        sock.close()
        raise Unavailable(f"{path} is served by uid {uid}, not by us; refusing it")
    return sock


def _reply(sock: socket.socket, path, timeout: float = REPLY_TIMEOUT_S):
    try:
        return wire.recv_msg(sock, MAX_REPLY, time.monotonic() + timeout, reply_decoder)
    except EOFError:
        raise Unavailable(f"{path} closed the connection without an answer: not a warm engine interpreter; "
                          "refusing it") from None
    except ProtocolError as e:
        raise Unavailable(f"{path} is not a warm engine interpreter ({e}); refusing it") from None
    except (TimeoutError, OSError) as e:
        raise Unavailable(f"{path} did not answer ({e}); refusing it") from None


def _request(path: str | Path, msg, timeout: float = 10.0):
    sock = connect(path, timeout)
    try:
        wire.send_msg(sock, msg)
        return _reply(sock, path, timeout)
    finally:
        sock.close()


def query(path: str | Path, timeout: float = 10.0) -> Status:
    reply = _request(path, Query(protocol=PROTOCOL), timeout)
    if not isinstance(reply, Status):
        raise Unavailable(f"{path}: expected a status, got {_what(reply)}")
    return reply


def retire(path: str | Path, timeout: float = 10.0) -> int:
    """Ask the warm interpreter at `path` to stop accepting (it exits once its engines have); their number."""
    reply = _request(path, Retire(protocol=PROTOCOL), timeout)
    if not isinstance(reply, Retiring):
        raise Unavailable(f"{path}: expected retiring, got {_what(reply)}")
    return reply.jobs


def check(path: str | Path, interpreter: str, env: dict[str, str], timeout: float = 10.0) -> str:
    """"" if an engine of this interpreter and environment would start warm at `path`, else why not."""
    reply = _request(path, Check(protocol=PROTOCOL, weightcache=__version__, interpreter=interpreter,
                                 env=dict(env)), timeout)
    if isinstance(reply, Accepted):
        return ""
    return _what(reply)


def _what(reply) -> str:
    if isinstance(reply, Refused):
        return reply.message
    return f"an unexpected {type(reply).__name__}"


# ------------------------------------------------------------------------------------------------ starting

def inheritable_fds() -> list[int]:
    """The fds an exec would pass on: stdin/stdout/stderr if open, and every other inheritable one."""
    out = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        names = ["0", "1", "2"]
    for name in names:
        fd = int(name)
        try:
            os.fstat(fd)
            if fd <= 2 or os.get_inheritable(fd):
                out.append(fd)
        except OSError:
            continue  # the listing's own fd, closed by now
    return sorted(out)


def _ignored_signals() -> list[int]:
    out = []
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(sig) is signal.SIG_IGN and sig not in (signal.SIGPIPE, signal.SIGXFSZ):
                out.append(int(sig))  # Python ignores SIGPIPE/SIGXFSZ itself: not the caller's choice
    return out


def start(path: str | Path, argv: list[str], *, interpreter: str, spawn: bool = True,
          env: dict[str, str] | None = None, ignored: list[int] | None = None) -> tuple[socket.socket, Started, int]:
    """Ask for the engine: (connection, Started, pidfd). Unavailable (one line) when it cannot start warm."""
    env = dict(os.environ if env is None else env)
    fds = inheritable_fds()
    if len(fds) > MAX_FDS:
        raise Unavailable(f"{len(fds)} inheritable fds, more than the {MAX_FDS} a warm start passes")
    sock = connect(path)
    try:
        run = Run(protocol=PROTOCOL, weightcache=__version__, interpreter=interpreter, argv=list(argv), env=env,
                  cwd=os.getcwd(), umask=_umask(), fds=fds,
                  ignored_signals=_ignored_signals() if ignored is None else ignored, spawn=spawn,
                  client=f"pid {os.getpid()}")
        try:
            wire.send_msg(sock, run)
            if fds:
                wire.send_fds(sock, fds)
        except OSError:
            pass  # it may have refused us already: its reason waits in our receive buffer
        reply = _reply(sock, path)
        if isinstance(reply, Refused):
            raise Unavailable(f"the warm engine interpreter at {path} was not used: {reply.message}")
        if not isinstance(reply, Started):
            raise Unavailable(f"{path}: expected started, got {_what(reply)}")
        try:
            (pidfd,) = wire.recv_fds(sock, 1)
        except (WeightCacheError, OSError, ValueError) as e:
            raise Unavailable(f"{path}: no pidfd for engine pid {reply.pid} ({e})") from None
    except BaseException:
        sock.close()
        raise
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)  # the engine holds them now (a pipe's reader must see EOF when the engine exits)
    return sock, reply, pidfd


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def wait(sock: socket.socket, started: Started, pidfd: int, pending: list[int],
         wake_r: int) -> tuple[int | None, int | None]:
    """Forward signals until the engine exits; (exit code, signal) with one of them None (both: unknown)."""
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    server_gone = exited_at = None
    buf = b""
    while True:
        events = dict(poller.poll(200))
        if wake_r in events:
            with contextlib.suppress(OSError):
                os.read(wake_r, 512)
        while pending:
            _forward(pidfd, pending.pop(0))
        if sock.fileno() in events and server_gone is None:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                server_gone = time.monotonic()
                poller.unregister(sock)
                poller.register(pidfd, select.POLLIN)
                print(f"weightcache run: the warm engine interpreter (pid {started.server_pid}) is gone; waiting "
                      f"for engine pid {started.pid} (its exit status will be unknown)", file=sys.stderr)
            elif data:
                buf += data
                msg = _frame(buf)
                if isinstance(msg, Exited):
                    return msg.code, msg.signal
        if server_gone is not None and pidfd in events:
            return None, None
        if exited_at is None and server_gone is None and select.select([pidfd], [], [], 0)[0]:
            exited_at = time.monotonic()  # its status follows from the server once it reaped it
        if exited_at is not None and time.monotonic() - exited_at > 10.0:
            return None, None


def _frame(buf: bytes):
    if len(buf) < 4:
        return None
    n = int.from_bytes(buf[:4], "big")
    if len(buf) < 4 + n:
        return None
    return wire.decode(buf[4:4 + n], reply_decoder)


def _forward(pidfd: int, sig: int) -> None:
    try:
        if sig == signal.SIGTSTP:  # the engine's group is orphaned: the kernel drops SIGTSTP there
            signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass


def exit_like(code: int | None, sig: int | None) -> int:
    """Leave as the engine left: killed by the same signal (without a core of our own), else its code."""
    if sig:
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)  # SIGKILL and SIGSTOP have no handler to reset
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
            time.sleep(0.5)
        return 128 + sig
    return EXIT_STATUS_UNKNOWN if code is None else code


def start_normally(argv: list[str], why: str, *, quiet: bool = False, label: str = "weightcache run") -> int:
    """exec the command as the shell would (only returns if that fails)."""
    if not quiet:
        print(f"{label}: {why}; starting {argv[0]} normally", file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(f"{label}: {argv[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"{label}: {argv[0]}: {e.strerror}", file=sys.stderr)
        return 126


def run_warm(path: str | Path, argv: list[str], interpreter: str, *, spawn: bool = True,
             quiet: bool = False, label: str = "weightcache run") -> tuple[int | None, int | None]:
    """Start warm and wait: (code, signal). Unavailable before anything started."""
    pending: list[int] = []
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old = {}
    ignored = _ignored_signals()  # stay ignored here (nohup) and in the engine

    def note(sig, _frame):
        pending.append(sig)

    for sig in FORWARDED:  # from here on: a signal before the engine exists is forwarded once it does
        if sig not in ignored:
            old[sig] = signal.signal(sig, note)
    old_wakeup = signal.set_wakeup_fd(wake_w)
    started = False
    try:
        sock, started, pidfd = start(path, argv, interpreter=interpreter, spawn=spawn, ignored=ignored)
        if not quiet:
            print(f"{label}: engine pid {started.pid} started from the warm interpreter (pid {started.server_pid})",
                  file=sys.stderr, flush=True)
        try:
            return wait(sock, started, pidfd, pending, wake_r)
        finally:
            sock.close()
            os.close(pidfd)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, h in old.items():
            signal.signal(sig, h)
        os.close(wake_r)
        os.close(wake_w)
        if not started:
            for sig in pending:  # none reached an engine: they are ours again
                os.kill(os.getpid(), sig)


def launch_python(socket_path: str, args: list[str]) -> int:
    """The spawn launcher's body: `python ARGS` from the warm interpreter, else exec Python itself."""
    argv = [sys.executable, *args]
    try:
        code, sig = run_warm(socket_path, argv, sys.executable, quiet=True, label="weightcache warm spawn")
    except Unavailable as e:
        return start_normally(argv, str(e), label="weightcache warm spawn")
    return exit_like(code, sig)


# ---------------------------------------------------------------------------------------------------- main

def engine_socket_dir(cmd: list[str]) -> str | None:
    """The socket directory an engine command names for its weights (vLLM's ``--model-loader-extra-config
    '{"socket_dir": ...}'``): the preload that serves them keeps its warm interpreter there."""
    raw = option_value(cmd, "--model-loader-extra-config")
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None  # the engine says what is wrong with it
    found = config.get("socket_dir") if isinstance(config, dict) else None
    return found if isinstance(found, str) and found else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="weightcache run", usage="weightcache run [options] -- CMD [ARGS...]",
        description="Start a Python engine (e.g. `vllm serve ...`, `python -m vllm.entrypoints.openai.api_server "
                    "...`) from the warm engine interpreter, with this process's argv, environment, cwd, stdio "
                    "and signals; exit as it exits. Without a warm interpreter, start it normally.")
    p.add_argument("--socket-dir", default=None,
                   help="default: the socket_dir of the command's --model-loader-extra-config, else the per-user "
                        "socket directory")
    p.add_argument("--require-warm", action="store_true", help="fail (exit 1) instead of starting normally")
    p.add_argument("--no-spawn", action="store_true",
                   help="the engine's multiprocessing spawn children start a fresh interpreter")
    p.add_argument("--quiet", action="store_true", help="no line when the engine starts warm")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command: weightcache run -- CMD [ARGS...]")
    socket_dir = args.socket_dir or engine_socket_dir(cmd)
    path = warm_socket_path(Path(socket_dir) if socket_dir else default_socket_dir_path())

    def fallback(why: str) -> int:
        if args.require_warm:
            print(f"weightcache run: error: {why}", file=sys.stderr)
            return 1
        return start_normally(cmd, why)

    try:
        interpreter = commands.resolve(cmd, dict(os.environ), os.getcwd()).interpreter
    except commands.NotPython as e:
        return fallback(f"{e}: not for the warm interpreter")
    try:
        code, sig = run_warm(path, cmd, interpreter, spawn=not args.no_spawn, quiet=args.quiet)
    except Unavailable as e:
        return fallback(str(e))
    if code is None and sig is None:
        print("weightcache run: the engine's exit status is unknown", file=sys.stderr)
    return exit_like(code, sig)
