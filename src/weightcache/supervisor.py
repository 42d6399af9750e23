"""`preload`: one daemon process per (role, placement), start-up and failure handling, signals, no orphans.

Start-up, per node:
1. spawn every daemon (multiprocessing "spawn"); each builds its source, derives its key, binds its
   socket (status works from here on) and reports the key;
2. agree with the other nodes through the rendezvous (same checkpoint stamp everywhere, every rank held
   exactly once), then tell every daemon to load;
3. wait until each (role, rank) is ready on every node; print one READY line; hold until SIGINT/SIGTERM.
A daemon that exits during start-up stops the start on every node. Children die with the supervisor
even when it is SIGKILLed (PR_SET_PDEATHSIG plus a lifeline pipe they watch).
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .errors import ArenaOutOfMemory
from .key import CacheKey
from .layout import Layout, Placement

log = logging.getLogger("weightcache.supervisor")

TERM_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
FAIL_GRACE_S = 0.5  # after a first failure, collect other ranks failing at the same moment
PR_SET_PDEATHSIG = 1
EXIT_OOM = 3  # a daemon ran out of device or host memory
GO = b"go"


class StartError(Exception):
    """The start failed; `code` is the exit code to use."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    # PDEATHSIG and the lifeline both send SIGTERM: a second one must not interrupt the clean-up
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated(signum)


@dataclass
class Group:
    """One daemon group (role) on this node: its layout and how each daemon gets its weights.

    Both callables run in the daemon process and must be module-level functions (spawn pickles them by
    reference): `make_source(placement, **source_args)` returns a Source, and
    `make_key(source, placement, layout=..., role=..., **key_args)` its CacheKey (default: the source's
    key_fields() over `key_args`, see `default_key`).
    """

    role: str
    layout: Layout
    make_source: Callable
    source_args: dict = field(default_factory=dict)
    make_key: Callable | None = None
    key_args: dict = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (single node only)
    info: dict = field(default_factory=dict)


def default_key(source, placement: Placement, *, layout: str, role: str, **base) -> CacheKey:
    """The source's key_fields() over `base`; fields CacheKey has no slot for go to `extra`."""
    return make_key(source.key_fields(), base=base, layout=layout, rank=placement.rank, role=role)


def make_key(fields: dict, *, base: dict, layout: str, rank: int, role: str) -> CacheKey:
    known = set(CacheKey.__struct_fields__)
    merged = {**base, **{k: v for k, v in fields.items() if v is not None}}
    extra = {k: str(v) for k, v in (merged.pop("extra", None) or {}).items()}
    extra.update({k: str(v) for k, v in merged.items() if k not in known})
    args = {k: v for k, v in merged.items() if k in known}
    args.update(layout=layout, rank=rank, role=role, extra=extra)
    return CacheKey(**args)


def stamp_of(key: CacheKey, layout: Layout) -> dict[str, str]:
    """What every node must agree on: the key without its rank and model path (paths may differ between
    nodes, content digests may not), plus the cluster shape."""
    raw = msgspec.structs.asdict(key)
    for k in ("rank", "model"):
        raw.pop(k)
    extra = raw.pop("extra") or {}
    out = {k: str(v) for k, v in raw.items()}
    out.update({f"extra.{k}": str(v) for k, v in extra.items()})
    out["nodes"] = str(layout.nodes)
    out["world_size"] = str(layout.world_size)
    return out


@dataclass(frozen=True)
class ChildSpec:
    """Everything one daemon process needs; pickled to the spawned child."""

    role: str
    placement: Placement
    layout: str
    socket_dir: str
    make_source: Callable
    source_args: dict
    make_key: Callable
    key_args: dict
    supervisor_pid: int
    master_addr: str
    master_port: int
    info: dict
    log_level: int = logging.INFO


# ---------------------------------------------------------------------------------------------- child side

def _die_with_parent(parent_pid: int, lifeline, go: threading.Event) -> None:
    """SIGTERM this process when the supervisor goes away, however it goes. The lifeline pipe also
    carries the supervisor's "go" (every node agreed: load now)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)

    def watch():
        try:
            while True:
                if lifeline.recv_bytes() == GO:
                    go.set()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(TERM_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="weightcache-lifeline", daemon=True).start()


def _send(conn, kind: str, **fields) -> None:
    try:
        conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())
    except OSError:
        pass  # the supervisor is gone; the lifeline ends us


def child_main(spec: ChildSpec, conn, lifeline) -> None:
    """One daemon process: source -> key -> socket -> (go) -> load -> serve."""
    go = threading.Event()
    _die_with_parent(spec.supervisor_pid, lifeline, go)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the supervisor alone; it stops the daemons
    p = spec.placement
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{spec.role} r{p.rank}] %(name)s: %(message)s")
    daemon = None
    code = 0
    try:
        from .daemon import Daemon
        from .naming import device_tag, socket_path

        if p.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(p.local_index)  # local index == device index
        source = spec.make_source(p, **spec.source_args)
        key = spec.make_key(source, p, layout=spec.layout, role=spec.role, **spec.key_args)
        if key.rank != p.rank or key.role != spec.role or key.layout != spec.layout:
            raise ValueError(f"make_key returned rank {key.rank}/{key.role}/{key.layout} for rank {p.rank}/"
                             f"{spec.role}/{spec.layout}")
        path = socket_path(spec.socket_dir, key, device_tag(p.device))
        info = {"placement": p.name(), "local_index": str(p.local_index), "node_rank": str(p.node_rank),
                **{k: str(v) for k, v in spec.info.items()}}
        daemon = Daemon(path, key, device=p.device, info=info)
        daemon.start()
        _send(conn, "started", socket=str(path), pid=os.getpid(), key=msgspec.to_builtins(key))
        while not go.wait(0.5):
            pass
        if hasattr(source, "load_into"):  # builds its own tensors (vLLM's loader); packs them with sharing kept
            source.load_into(daemon)
        else:
            daemon.load(source)
        st = daemon.status()
        _send(conn, "ready", nbytes=st.nbytes, ntensors=st.ntensors, load_seconds=st.load_seconds)
        daemon.serve_forever()
    except _Terminated:
        code = 0
    except BaseException as e:
        oom = isinstance(e, (ArenaOutOfMemory, MemoryError)) or type(e).__name__ == "OutOfMemoryError"
        code = EXIT_OOM if oom else 1
        if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code:
            code = e.code
        message = f"{type(e).__name__}: {e}"
        log.error("failed: %s\n%s", message, traceback.format_exc())
        _send(conn, "failed", message=message)
    finally:
        if daemon is not None:
            daemon.close()
    # Skip interpreter finalization: with torch loaded it can hang in garbage collection at exit, and
    # nothing is left to clean up (socket removed, memory returns to the kernel).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------------------- supervisor side

@dataclass
class Child:
    spec: ChildSpec
    proc: mp.Process
    conn: object  # read end of the status pipe
    lifeline: object  # write end; "go" goes through it, closing it (or dying) ends the child
    socket: str = ""
    key: CacheKey | None = None
    state: str = "spawned"  # spawned | started | ready | failed
    message: str = ""
    ready_info: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        p = self.spec.placement
        return f"rank {p.rank} ({self.spec.role}, {p.device})"

    @property
    def exited(self) -> bool:
        return self.proc.exitcode is not None

    def drain(self) -> None:
        while self.conn is not None:
            try:
                if not self.conn.poll():
                    return
                msg = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                self.conn.close()
                self.conn = None
                return
            kind = msg.get("kind")
            if kind == "started":
                self.socket, self.state = msg["socket"], "started"
                self.key = msgspec.convert(msg["key"], CacheKey)
            elif kind == "ready":
                self.state, self.ready_info = "ready", msg
            elif kind == "failed":
                self.state, self.message = "failed", msg.get("message", "")


def exit_code_of(exitcode: int | None) -> int:
    """The supervisor's exit code for a daemon's: a signal N maps to 128+N, a clean 0 during start-up to 1."""
    if exitcode is None:
        return 1
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


def ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class Supervisor:
    def __init__(self, groups: list[Group], *, socket_dir: str | Path, health_host: str = "127.0.0.1",
                 health_port: int | None = None, start_timeout: float = 3600.0,
                 rendezvous_timeout: float = 600.0, log_level: int = logging.INFO, ready_stream=None):
        if not groups:
            raise StartError("nothing to preload", 2)
        roles = [g.role for g in groups]
        if len(set(roles)) != len(roles):
            raise StartError(f"each role may appear once, got {roles}", 2)
        ports = [g.master_port for g in groups if g.master_port]
        if len(set(ports)) != len(ports):
            raise StartError(f"every daemon group needs its own rendezvous port, got {ports} for {roles}", 2)
        if len({(g.layout.this_node, g.layout.nodes) for g in groups}) != 1:
            raise StartError("all daemon groups of a node must span the same nodes", 2)
        self.groups = groups
        self.socket_dir = Path(socket_dir)
        self.health_host, self.health_port = health_host, health_port
        self.start_timeout, self.rendezvous_timeout = start_timeout, rendezvous_timeout
        self.log_level = log_level
        self.ready_stream = ready_stream
        self.children: list[Child] = []
        self.rendezvous: dict = {}
        self.http = None
        self.ready = False
        self._ctx = mp.get_context("spawn")
        self._reported: set[int] = set()
        self._marked: set[str] = set()

    @property
    def node_rank(self) -> int:
        return self.groups[0].layout.this_node

    @property
    def nnodes(self) -> int:
        return self.groups[0].layout.nodes

    # -- lifecycle ---------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything and hold it until SIGINT/SIGTERM; returns the exit code."""
        old = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGINT, signal.SIGTERM)}
        failure: BaseException | None = None
        code = 0
        try:
            self.start()
            code = self.hold()
        except _Terminated as t:
            log.info("%s received: stopping every daemon", t)
            if not self.ready:  # the other nodes must not wait for this one
                failure = StartError(f"node {self.node_rank} was stopped ({t}) during start-up", 0)
        except BaseException as e:
            failure = e
            code = e.code if isinstance(e, StartError) else 1
            log.error("%s", e)
        finally:
            for s in old:  # a second signal must not cut the clean-up short
                signal.signal(s, signal.SIG_IGN)
            self.shutdown(failure)
            for s, h in old.items():
                signal.signal(s, h)
        return code

    def start(self) -> None:
        from .naming import ensure_private_dir
        from .rendezvous import Rendezvous

        ensure_private_dir(self.socket_dir)
        if self.health_port is not None:
            self._start_http()
        for g in self.groups:
            rdv = Rendezvous(group=g.role, master_addr=g.master_addr, master_port=g.master_port,
                             nnodes=g.layout.nodes, node_rank=g.layout.this_node, timeout=self.rendezvous_timeout)
            self.rendezvous[g.role] = rdv
            g.master_port = rdv.start()
        n = sum(len(g.layout.local_placements()) for g in self.groups)
        log.info("node %d/%d: starting %d daemon(s) in %s (rendezvous ports %s)", self.node_rank, self.nnodes,
                 n, self.socket_dir, ", ".join(f"{g.role} {g.master_port}" for g in self.groups))
        for g in self.groups:
            for p in g.layout.local_placements():
                self._spawn(g, p)
        self._wait_for(lambda: all(c.state in ("started", "ready") for c in self.children), "to open its socket")
        for g in self.groups:
            self._agree(g)
        for c in self.children:
            c.lifeline.send_bytes(GO)
        self._wait_for(self._all_ready, "to load")
        self.ready = True
        self._print_ready()

    def hold(self) -> int:
        """Watch the daemons until a signal arrives. One that dies is logged (and /health turns 503); when
        none is left, return the worst exit code."""
        while True:
            sentinels = [c.proc.sentinel for c in self.children if not c.exited]
            if sentinels:
                mpc.wait(sentinels, timeout=1.0)
            else:
                time.sleep(1.0)
            for c in self.children:
                c.drain()
                if c.exited and id(c) not in self._reported:
                    self._reported.add(id(c))
                    log.error("%s exited with code %s after it was ready%s", c.label, c.proc.exitcode,
                              f": {c.message}" if c.message else "")
            if all(c.exited for c in self.children):
                log.error("every daemon of this node has exited; stopping")
                return max(exit_code_of(c.proc.exitcode) for c in self.children)

    def shutdown(self, failure: BaseException | None = None) -> None:
        from .rendezvous import RendezvousError

        if failure is not None and not isinstance(failure, RendezvousError):
            for rdv in self.rendezvous.values():
                rdv.fail(str(failure))
        self._terminate_children()
        for rdv in self.rendezvous.values():
            rdv.close()
        if self.http is not None:
            self.http.stop()
            self.http = None

    # -- start-up ----------------------------------------------------------------------------------------

    def _spawn(self, g: Group, p: Placement) -> None:
        spec = ChildSpec(role=g.role, placement=p, layout=g.layout.describe(), socket_dir=str(self.socket_dir),
                         make_source=g.make_source, source_args=dict(g.source_args),
                         make_key=g.make_key or default_key, key_args=dict(g.key_args),
                         supervisor_pid=os.getpid(), master_addr=g.master_addr,
                         master_port=g.master_port, info=dict(g.info), log_level=self.log_level)
        status_r, status_w = self._ctx.Pipe(duplex=False)
        life_r, life_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=child_main, args=(spec, status_w, life_r),
                                 name=f"weightcache-{g.role}-r{p.rank}")
        proc.start()
        status_w.close()  # the child holds the only writer: EOF when it dies
        life_r.close()  # the child holds the only reader of its lifeline
        self.children.append(Child(spec, proc, status_r, life_w))

    def _check_children(self) -> None:
        for c in self.children:
            c.drain()
        if any(c.exited for c in self.children):
            self._fail_start()

    def _wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        last_note = time.monotonic()
        while True:
            waitables = [c.conn for c in self.children if c.conn is not None]
            waitables += [c.proc.sentinel for c in self.children if not c.exited]
            mpc.wait(waitables, timeout=0.1)
            self._check_children()
            if done():
                return
            if time.monotonic() > deadline:
                waiting = [f"{c.label}: {c.state}" for c in self.children if c.state != "ready"]
                raise StartError(f"node {self.node_rank}/{self.nnodes}: start-up timed out after "
                                 f"{self.start_timeout:.0f} s waiting for every daemon {what}; "
                                 + ("; ".join(waiting) or "other nodes not ready"))
            if time.monotonic() - last_note > 30:
                last_note = time.monotonic()
                log.info("waiting for %s", ", ".join(f"{c.label} ({c.state})" for c in self.children
                                                     if c.state != "ready") or "the other nodes")

    def _agree(self, g: Group) -> None:
        from .key import diff

        mine = [c for c in self.children if c.spec.role == g.role]
        ref = mine[0].key
        for c in mine[1:]:
            d = diff(ref.replace(rank=c.key.rank), c.key)
            if d:
                fields = ", ".join(f"{x.field}: {x.expected!r} vs {x.actual!r}" for x in d)
                raise StartError(f"{g.role} ranks {mine[0].spec.placement.rank} and {c.spec.placement.rank} "
                                 f"of this node built different keys ({fields})")
        self.rendezvous[g.role].agree(stamp_of(ref, g.layout), [c.key.rank for c in mine], g.layout.world_size,
                                      on_poll=self._check_children)

    def _all_ready(self) -> bool:
        if not all(c.state == "ready" for c in self.children):
            return False
        for role, rdv in self.rendezvous.items():
            if role not in self._marked:
                mine = [c for c in self.children if c.spec.role == role]
                rdv.mark_ready({"ranks": [c.spec.placement.rank for c in mine],
                                "nbytes": sum(int(c.ready_info.get("nbytes", 0)) for c in mine)})
                self._marked.add(role)
        return all(rdv.poll_ready() for rdv in self.rendezvous.values())

    def _fail_start(self) -> None:
        # Ranks that fail together (one bad file read by every rank) are reported together.
        end = time.monotonic() + FAIL_GRACE_S
        while time.monotonic() < end and any(not c.exited for c in self.children):
            mpc.wait([c.proc.sentinel for c in self.children if not c.exited], timeout=0.05)
        for c in self.children:
            c.drain()
        dead = [c for c in self.children if c.exited]
        lines, worst = [], 0
        for c in dead:
            self._reported.add(id(c))
            worst = max(worst, exit_code_of(c.proc.exitcode))
            why = c.message or (f"killed by {signal.Signals(-c.proc.exitcode).name}" if c.proc.exitcode < 0
                                else "exited without saying why")
            lines.append(f"{c.label} exited with code {c.proc.exitcode}: {why}")
        ranks = sorted(c.spec.placement.rank for c in dead)
        others = [f"{c.spec.role} rank {c.spec.placement.rank} ({c.state})" for c in self.children if not c.exited]
        if others:
            lines.append("stopping the others: " + ", ".join(others))
        raise StartError(
            f"node {self.node_rank}/{self.nnodes}: {len(dead)} of {len(self.children)} daemon(s) failed during "
            f"start-up (rank {ranks_text(ranks)}):\n  " + "\n  ".join(lines), worst)

    # -- shutdown ----------------------------------------------------------------------------------------

    def _terminate_children(self) -> None:
        alive = [c for c in self.children if not c.exited]
        for c in alive:
            try:
                c.proc.terminate()
            except OSError:
                pass
        deadline = time.monotonic() + TERM_GRACE_S
        for c in alive:
            c.proc.join(max(0.0, deadline - time.monotonic()))
        for c in self.children:
            if not c.exited:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it", c.label, TERM_GRACE_S)
                c.proc.kill()
                c.proc.join(5)
            c.drain()
            try:
                c.lifeline.close()
            except OSError:
                pass
            if c.socket:  # a daemon that was killed leaves its socket behind
                try:
                    if stat.S_ISSOCK(os.lstat(c.socket).st_mode):
                        os.unlink(c.socket)
                except OSError:
                    pass

    def _print_ready(self) -> None:
        from .status_table import human_bytes

        parts = []
        for g in self.groups:
            local = g.layout.local_placements()
            devices = sorted({p.device for p in local})
            parts.append(f"{g.role}: rank {ranks_text([p.rank for p in local])} of {g.layout.world_size} "
                         f"({g.layout.describe()}) on {','.join(devices)}")
        nbytes = sum(int(c.ready_info.get("nbytes", 0)) for c in self.children)
        per_role = {len(g.layout.local_placements()) for g in self.groups}
        ranks = per_role.pop() if len(per_role) == 1 else "/".join(
            str(len(g.layout.local_placements())) for g in self.groups)
        seconds = max((float(c.ready_info.get("load_seconds", 0)) for c in self.children), default=0.0)
        loaded = f" loaded in {seconds:.1f} s ({nbytes / seconds / 1e9:.2f} GB/s)" if seconds > 0 else ""
        line = (f"weightcache READY node {self.node_rank}/{self.nnodes}: {ranks} rank(s) x {len(self.groups)} "
                f"role(s) [{'; '.join(parts)}], {human_bytes(nbytes)}{loaded}, sockets in {self.socket_dir}")
        if self.http is not None:
            line += f", health http://{self.health_host}:{self.http.port}/health"
        print(line, file=self.ready_stream or sys.stdout, flush=True)

    # -- HTTP --------------------------------------------------------------------------------------------

    def entries(self):
        """The local daemons as /health, /metrics and /status see them (asked over their sockets now)."""
        from .client import query_status
        from .http import DaemonEntry

        out = []
        for c in list(self.children):
            c.drain()
            p = c.spec.placement
            e = DaemonEntry(c.spec.role, p.rank, c.socket, device=p.device, pid=c.proc.pid)
            e.alive = not c.exited
            if not e.alive:
                e.exitcode = c.proc.exitcode
                e.error = f"process exited with code {c.proc.exitcode}"
            elif not c.socket:
                e.error = "starting (not listening yet)"
            else:
                try:
                    e.status = query_status(c.socket, timeout=1.0)
                except Exception as ex:
                    e.error = str(ex) or type(ex).__name__
            out.append(e)
        return out

    def info(self) -> dict:
        return {
            "node_rank": self.node_rank, "nnodes": self.nnodes, "ready": self.ready,
            "socket_dir": str(self.socket_dir),
            "groups": [{"role": g.role, "layout": g.layout.describe(), "world_size": g.layout.world_size,
                        "master_port": g.master_port,
                        "cluster": self.rendezvous[g.role].cluster_state() if g.role in self.rendezvous else {}}
                       for g in self.groups],
        }

    def _start_http(self) -> None:
        from .http import HealthServer, build_app

        self.http = HealthServer(build_app(self.entries, self.info), self.health_host, self.health_port)
        try:
            port = self.http.start()
        except (OSError, TimeoutError) as e:
            self.http = None
            raise StartError(f"{e}; pick another --weight-cache-health-port", 2) from e
        log.info("health on http://%s:%d/health", self.health_host, port)
