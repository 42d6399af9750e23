"""`preload`: one daemon process per (role, placement), start-up and failure handling, signals, no orphans.

Start-up, per node:
1. spawn every daemon (multiprocessing "spawn"); each builds its source, derives its key, binds its
   socket (status works from here on) and reports the key;
2. agree with the other nodes through the rendezvous (same checkpoint stamp everywhere, every rank held
   exactly once), then tell every daemon to load;
3. wait until each (role, rank) is ready on every node; print one READY line; hold until SIGINT/SIGTERM.
A daemon that exits during start-up stops the start on every node. Children die with the supervisor
even when it is SIGKILLed (PR_SET_PDEATHSIG plus a lifeline pipe they watch).

With a custodian (custodian.py, the default), each daemon first asks it for the cache of its exact key and
serves that without a load; a daemon that loads hands its blocks to the custodian. So a daemon that dies
after READY is replaced at once (no checkpoint read), and a `preload` that was SIGKILLed comes back READY
without a load. An orderly stop releases the weights unless asked to keep them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
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

from .errors import ArenaOutOfMemory, WeightCacheError
from .key import CacheKey
from .layout import Layout, Placement

log = logging.getLogger("weightcache.supervisor")

TERM_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
FAIL_GRACE_S = 0.5  # after a first failure, collect other ranks failing at the same moment
PR_SET_PDEATHSIG = 1
EXIT_OOM = 3  # a daemon ran out of device or host memory
EXIT_KEY_CHANGED = 4  # a replacement daemon computed another key than its rank agreed on: never restarted
MAX_FAILED_RESTARTS = 5  # consecutive replacements that died before ready: give up on that rank
RESTART_BACKOFF_MAX_S = 30.0
GO = b"go"  # every node agreed: take the cache from the custodian if it holds it, else load
LOAD = b"load"  # load afresh (some rank of the group has nothing held: its ranks load together)
ADOPT = b"adopt"  # take the cache from the custodian or fail (a rank that cannot load alone)


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
    loads_alone: bool = True  # a rank's source loads without its peers (False: vLLM's loader with a process group)


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
    custodian: str = ""  # the custodian's socket: adopt the cache it holds, deposit a fresh load
    loads_alone: bool = True
    expect_key: CacheKey | None = None  # a replacement daemon must compute exactly this key


# ---------------------------------------------------------------------------------------------- child side

def _die_with_parent(parent_pid: int, lifeline, go: threading.Event, mode: list) -> None:
    """SIGTERM this process when the supervisor goes away, however it goes. The lifeline pipe also
    carries the supervisor's "go" (every node agreed: load now) and how (GO, LOAD or ADOPT, into `mode`)."""
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
                msg = lifeline.recv_bytes()
                if msg in (GO, LOAD, ADOPT):
                    mode[:] = [msg]
                    go.set()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(TERM_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="weightcache-lifeline", daemon=True).start()


class LazySource:
    """The group's source, built on first use: a daemon that takes its cache from the custodian never builds
    it (building one may read the checkpoint's headers)."""

    def __init__(self, make: Callable, placement: Placement, args: dict):
        self._make, self._placement, self._args = make, placement, args
        self._source = None

    def get(self):
        if self._source is None:
            self._source = self._make(self._placement, **self._args)
        return self._source

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


def _send(conn, kind: str, **fields) -> None:
    try:
        conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())
    except OSError:
        pass  # the supervisor is gone; the lifeline ends us


def child_main(spec: ChildSpec, conn, lifeline) -> None:
    """One daemon process: source -> key -> socket -> (go) -> load -> serve."""
    go, mode = threading.Event(), [GO]
    _die_with_parent(spec.supervisor_pid, lifeline, go, mode)
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
        source = LazySource(spec.make_source, p, spec.source_args)
        key = spec.make_key(source, p, layout=spec.layout, role=spec.role, **spec.key_args)
        if key.rank != p.rank or key.role != spec.role or key.layout != spec.layout:
            raise ValueError(f"make_key returned rank {key.rank}/{key.role}/{key.layout} for rank {p.rank}/"
                             f"{spec.role}/{spec.layout}")
        if spec.expect_key is not None:
            from .key import diff

            changed = diff(spec.expect_key, key)
            if changed:
                code = EXIT_KEY_CHANGED
                raise ValueError("the weights changed since this rank started (" + ", ".join(
                    f"{d.field}: {d.expected!r} -> {d.actual!r}" for d in changed) + "); restart preload")
        path = socket_path(spec.socket_dir, key, device_tag(p.device))
        info = {"placement": p.name(), "local_index": str(p.local_index), "node_rank": str(p.node_rank),
                **{k: str(v) for k, v in spec.info.items()}}
        daemon = Daemon(path, key, device=p.device, info=info, custodian=spec.custodian or None)
        daemon.start()
        _send(conn, "started", socket=str(path), pid=os.getpid(), key=msgspec.to_builtins(key))
        while not go.wait(0.5):
            pass
        if mode[0] != LOAD and daemon.adopt():
            pass  # the custodian held this exact cache: served again without a load
        elif mode[0] == ADOPT:
            raise RuntimeError("the custodian holds no cache for this rank, and its source loads only together "
                               "with every rank of its group: restart preload")
        elif hasattr(source.get(), "load_into"):  # builds its own tensors (vLLM's loader); packed, sharing kept
            source.load_into(daemon)
        else:
            daemon.load(source.get())
        st = daemon.status()
        _send(conn, "ready", nbytes=st.nbytes, ntensors=st.ntensors, load_seconds=st.load_seconds,
              adopted=st.adopted, held=st.held, ready_seconds=st.ready_seconds)
        daemon.serve_forever()
    except _Terminated:
        code = 0
    except BaseException as e:
        oom = isinstance(e, (ArenaOutOfMemory, MemoryError)) or type(e).__name__ == "OutOfMemoryError"
        code = EXIT_OOM if oom else (code or 1)
        if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code:
            code = e.code
        message = f"{type(e).__name__}: {e}"
        if isinstance(e, WeightCacheError):  # says what is wrong already: the traceback only at DEBUG
            log.error("failed: %s", message)
            log.debug("%s", traceback.format_exc())
        else:
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
    replacement: bool = False  # started after READY in place of a daemon that died
    go_sent: bool = False
    announced: bool = False
    reported: bool = False  # its exit was logged
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the HTTP thread drains too

    @property
    def label(self) -> str:
        p = self.spec.placement
        return f"rank {p.rank} ({self.spec.role}, {p.device})"

    @property
    def exited(self) -> bool:
        return self.proc.exitcode is not None

    def drain(self) -> None:
        with self.lock:
            self._drain()

    def _drain(self) -> None:
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


def remove_stale_socket(path: Path) -> None:
    """Unlink a socket no daemon listens on any more."""
    import socket

    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return
    except OSError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        with contextlib.suppress(OSError):
            path.unlink()
    except OSError:
        pass
    finally:
        probe.close()


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
                 rendezvous_timeout: float = 600.0, log_level: int = logging.INFO, ready_stream=None,
                 custodian: bool = True, keep_on_stop: bool = False, restart: bool = True):
        if not groups:
            raise StartError("nothing to preload", 2)
        if health_port is not None and not 0 <= health_port <= 65535:
            raise StartError(f"health port {health_port} is outside 0..65535", 2)
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
        self._marked: set[str] = set()
        self.use_custodian, self.keep_on_stop, self.restart = custodian, keep_on_stop, restart
        self.custodian = None  # our connection to it (custodian.CustodianClient); it lives while we do
        self._custodian_lost = False
        self._stopped_by_signal = False
        self._owned: set[str] = set()  # names (socket file names) our daemons bound: the caches we stand for
        self._keys: dict[tuple[str, int], CacheKey] = {}  # (role, rank) -> the key agreed at start
        self.restarts: dict[tuple[str, int], int] = {}
        self._failed_restarts: dict[tuple[str, int], int] = {}
        self._pending: dict[int, float] = {}  # child index -> when to start its replacement
        self._retired: list[Child] = []  # replaced children, closed a round later (the HTTP thread may look)

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
            self._stopped_by_signal = True
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
        if self.use_custodian:
            self._open_custodian()
        else:
            self._note_custodian()
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
        self._prune()
        held = {g.role: self._held_here(g) for g in self.groups}
        go = {}
        for g in self.groups:
            go[g.role] = GO if self._agree(g, held[g.role]) else LOAD
            if go[g.role] == LOAD and held[g.role] is not None:
                self._release_group(g)  # held for some ranks only: they load together with the others
        for c in self.children:
            self._keys[(c.spec.role, c.spec.placement.rank)] = c.key
        for c in self.children:
            c.lifeline.send_bytes(go[c.spec.role])
        self._wait_for(self._all_ready, "to load")
        self.ready = True
        adopted = [c for c in self.children if c.ready_info.get("adopted")]
        if adopted:
            slowest = max(float(c.ready_info.get("load_seconds", 0)) for c in adopted)
            log.info("%d of %d daemon(s) took their weights from the custodian (no load; the slowest in %.1f ms)",
                     len(adopted), len(self.children), slowest * 1e3)
        self._print_ready()

    def hold(self) -> int:
        """Watch the daemons until a signal arrives. One that dies is logged (and /health turns 503) and
        replaced by a new daemon for its rank, which takes the cache from the custodian (a replacement that
        dies before it is ready is retried with a growing delay, then given up). When no daemon is left and
        none is due to be replaced, return the worst exit code."""
        while True:
            code = self.hold_once()
            if code is not None:
                return code

    def hold_once(self) -> int | None:
        """One round of hold(): wait up to a second for news, handle it; the exit code once all is over."""
        waitables = [c.proc.sentinel for c in self.children if not c.exited]
        waitables += [c.conn for c in self.children if c.conn is not None and c.state != "ready"]
        if waitables:
            mpc.wait(waitables, timeout=0.2 if self._pending else 1.0)
        else:
            time.sleep(0.2)
        for i, c in enumerate(self.children):
            c.drain()
            if c.socket:
                self._owned.add(Path(c.socket).name)
            if c.replacement:
                self._tend_replacement(c)
            if c.exited and not c.reported:
                c.reported = True
                self._on_exit(i, c)
        self._start_due_replacements()
        self._watch_custodian()
        if all(c.reported for c in self.children) and not self._pending:  # each exit handled
            log.error("every daemon of this node has exited; stopping")
            return max(exit_code_of(c.proc.exitcode) for c in self.children)
        return None

    def _on_exit(self, i: int, c: Child) -> None:
        slot = (c.spec.role, c.spec.placement.rank)
        why = f": {c.message}" if c.message else ""
        if c.state == "ready":
            self._failed_restarts[slot] = 0
            log.error("%s exited with code %s after it was ready%s", c.label, c.proc.exitcode, why)
        else:
            self._failed_restarts[slot] = self._failed_restarts.get(slot, 0) + 1
            log.error("%s (a replacement) exited with code %s before it was ready%s", c.label, c.proc.exitcode, why)
        if not self.restart:
            return
        if c.proc.exitcode == EXIT_KEY_CHANGED:
            log.error("%s is not replaced: its weights changed on disk; restart preload to serve them", c.label)
            return
        failures = self._failed_restarts[slot]
        if failures >= MAX_FAILED_RESTARTS:
            log.error("%s: %d replacements in a row died before they were ready; giving up on it", c.label, failures)
            return
        delay = 0.0 if failures == 0 else min(RESTART_BACKOFF_MAX_S, 2.0 ** (failures - 1))
        log.warning("%s: starting a replacement%s", c.label, f" in {delay:.0f} s" if delay else "")
        self._pending[i] = time.monotonic() + delay

    def _start_due_replacements(self) -> None:
        for old in self._retired:
            with contextlib.suppress(ValueError):
                old.proc.close()  # its sentinel fd
        self._retired.clear()
        now = time.monotonic()
        for i, due in sorted(self._pending.items()):
            if due > now:
                continue
            del self._pending[i]
            old = self.children[i]
            slot = (old.spec.role, old.spec.placement.rank)
            with contextlib.suppress(OSError):
                old.lifeline.close()
            spec = dataclasses.replace(old.spec, expect_key=self._keys.get(slot), supervisor_pid=os.getpid())
            new = self._start_child(spec)
            new.replacement = True
            self.children[i] = new
            self.restarts[slot] = self.restarts.get(slot, 0) + 1
            self._retired.append(old)

    def _tend_replacement(self, c: Child) -> None:
        """A replacement daemon needs no agreement (its key is checked against the agreed one): go at once."""
        if c.state == "started" and not c.go_sent:
            c.go_sent = True
            with contextlib.suppress(OSError):
                c.lifeline.send_bytes(GO if c.spec.loads_alone else ADOPT)
        if c.state == "ready" and not c.announced:
            c.announced = True
            slot = (c.spec.role, c.spec.placement.rank)
            self._failed_restarts[slot] = 0
            info = c.ready_info
            how = (f"took its weights from the custodian in {float(info.get('load_seconds', 0)) * 1e3:.1f} ms "
                   "(no load)" if info.get("adopted") else f"loaded in {float(info.get('load_seconds', 0)):.2f} s")
            log.info("%s is back (replacement %d, pid %d): %s; %.1f ms from its socket to ready", c.label,
                     self.restarts.get(slot, 0), c.proc.pid, how, float(info.get("ready_seconds", 0)) * 1e3)

    # -- the custodian -----------------------------------------------------------------------------------

    def _open_custodian(self) -> None:
        from .custodian import connect_or_launch
        from .errors import WeightCacheError
        from .status_table import human_bytes

        try:
            self.custodian = connect_or_launch(self.socket_dir, client=f"supervisor pid {os.getpid()}")
        except WeightCacheError as e:
            log.warning("no custodian (%s): the weights will not outlive their daemons", e)
            return
        held = self.custodian.holdings().holdings
        log.info("custodian pid %d holds %d cache(s)%s", self.custodian.pid, len(held),
                 f" ({human_bytes(sum(h.nbytes for h in held))})" if held else "")

    def _note_custodian(self) -> None:
        """Without a custodian of our own, say what one left in this directory still holds."""
        from .custodian import CustodianClient, socket_path_in
        from .errors import WeightCacheError
        from .status_table import human_bytes

        if not socket_path_in(self.socket_dir).exists():
            return
        try:
            client = CustodianClient.connect(self.socket_dir, timeout=5.0)
            try:
                held = client.holdings().holdings
            finally:
                client.close()
        except WeightCacheError:
            return
        if held:
            log.warning("a custodian still holds %d cache(s) (%s) in %s; `weightcache release --socket-dir %s` "
                        "frees them", len(held), human_bytes(sum(h.nbytes for h in held)), self.socket_dir,
                        self.socket_dir)

    def _custodian_socket(self) -> str:
        return str(self.custodian.path) if self.custodian is not None else ""

    def _prune(self) -> None:
        """Release what the custodian holds for our roles and models under other keys (other flags, another
        layout, a changed checkpoint) before anything loads: the memory is needed, and it is never served."""
        if self.custodian is None:
            return
        from .errors import WeightCacheError
        from .status_table import human_bytes

        for g in self.groups:
            mine = [c for c in self.children if c.spec.role == g.role]
            keep = [Path(c.socket).name for c in mine]
            try:
                gone = self.custodian.prune(g.role, mine[0].key.model, keep)
            except WeightCacheError as e:
                log.warning("custodian: %s", e)
                continue
            if gone.names:
                log.info("released %d cache(s) of %s held under another key (%s): %s", len(gone.names),
                         mine[0].key.model, human_bytes(gone.nbytes), ", ".join(gone.names))
            for name in gone.names:  # the sockets their killed daemons left behind
                remove_stale_socket(self.socket_dir / name)

    def _held_here(self, g: Group) -> bool | None:
        """Whether the custodian holds every local cache of the group (None: it holds none of them)."""
        if self.custodian is None:
            return None
        from .errors import WeightCacheError

        try:
            names = {h.name for h in self.custodian.holdings().holdings}
        except WeightCacheError:
            return None
        mine = {Path(c.socket).name for c in self.children if c.spec.role == g.role}
        return True if mine <= names else (False if mine & names else None)

    def _release_group(self, g: Group) -> None:
        from .errors import WeightCacheError

        names = [Path(c.socket).name for c in self.children if c.spec.role == g.role]
        try:
            gone = self.custodian.release(names)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
            return
        if gone.names:
            log.info("%s: the custodian holds the weights of some ranks only; released them (%s): every rank "
                     "loads afresh", g.role, ", ".join(gone.names))

    def _watch_custodian(self) -> None:
        if self.custodian is not None and not self._custodian_lost and self.custodian.lost():
            self._custodian_lost = True
            log.error("the custodian (pid %d) is gone: the weights now live only as long as their daemons",
                      self.custodian.pid)

    def _release_held(self, failure: BaseException | None) -> None:
        if self.custodian is None:
            return
        from .errors import WeightCacheError

        self._owned.update(Path(c.socket).name for c in self.children if c.socket)
        try:
            if failure is not None or not (self.keep_on_stop and self._stopped_by_signal):
                gone = self.custodian.release(sorted(self._owned))
                if gone.names:
                    log.info("released %d cache(s) held by the custodian", len(gone.names))
            else:
                held = {h.name for h in self.custodian.holdings().holdings} & self._owned
                log.info("the custodian (pid %d) keeps %d cache(s) for the next preload; `weightcache release "
                         "--socket-dir %s` frees them", self.custodian.pid, len(held), self.socket_dir)
        except WeightCacheError as e:
            log.warning("custodian: %s", e)
        finally:
            self.custodian.close()
            self.custodian = None

    def shutdown(self, failure: BaseException | None = None) -> None:
        from .rendezvous import RendezvousError

        if failure is not None and not isinstance(failure, RendezvousError):
            for rdv in self.rendezvous.values():
                rdv.fail(str(failure))
        self._pending.clear()
        self._terminate_children()
        self._release_held(failure)
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
                         master_port=g.master_port, info=dict(g.info), log_level=self.log_level,
                         custodian=self._custodian_socket(), loads_alone=g.loads_alone)
        self.children.append(self._start_child(spec))

    def _start_child(self, spec: ChildSpec) -> Child:
        p = spec.placement
        status_r, status_w = self._ctx.Pipe(duplex=False)
        life_r, life_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=child_main, args=(spec, status_w, life_r),
                                 name=f"weightcache-{spec.role}-r{p.rank}")
        proc.start()
        status_w.close()  # the child holds the only writer: EOF when it dies
        life_r.close()  # the child holds the only reader of its lifeline
        return Child(spec, proc, status_r, life_w)

    def _check_children(self) -> None:
        for c in self.children:
            c.drain()
            if c.socket:
                self._owned.add(Path(c.socket).name)
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

    def _agree(self, g: Group, held: bool | None) -> bool:
        """Every node builds the same keys; returns whether each node holds the group's every local cache
        (then the group adopts; a partly held group loads afresh: its ranks may load only together)."""
        from .key import diff

        mine = [c for c in self.children if c.spec.role == g.role]
        ref = mine[0].key
        for c in mine[1:]:
            d = diff(ref.replace(rank=c.key.rank), c.key)
            if d:
                fields = ", ".join(f"{x.field}: {x.expected!r} vs {x.actual!r}" for x in d)
                raise StartError(f"{g.role} ranks {mine[0].spec.placement.rank} and {c.spec.placement.rank} "
                                 f"of this node built different keys ({fields})")
        rdv = self.rendezvous[g.role]
        rdv.agree(stamp_of(ref, g.layout), [c.key.rank for c in mine], g.layout.world_size,
                  on_poll=self._check_children, held=bool(held))
        return rdv.all_held

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
            c.reported = True
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
            e = DaemonEntry(c.spec.role, p.rank, c.socket, device=p.device, pid=c.proc.pid,
                            restarts=self.restarts.get((c.spec.role, p.rank), 0))
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
            "socket_dir": str(self.socket_dir), "custodian": self._custodian_info(),
            "groups": [{"role": g.role, "layout": g.layout.describe(), "world_size": g.layout.world_size,
                        "master_port": g.master_port,
                        "cluster": self.rendezvous[g.role].cluster_state() if g.role in self.rendezvous else {}}
                       for g in self.groups],
        }

    def _custodian_info(self) -> dict:
        client = self.custodian
        if client is None or self._custodian_lost:
            return {"up": False}
        return {"up": True, "pid": client.pid, "socket": str(client.path)}

    def _custodian_metrics(self) -> list[tuple[str, str, float]]:
        return [("weightcache_custodian_up", "1 while the custodian that keeps the caches past their daemons runs",
                 1.0 if self._custodian_info()["up"] else 0.0)]

    def _start_http(self) -> None:
        from .http import HealthServer, build_app

        self.http = HealthServer(build_app(self.entries, self.info, self._custodian_metrics), self.health_host,
                                 self.health_port)
        try:
            port = self.http.start()
        except (OSError, TimeoutError) as e:
            self.http = None
            raise StartError(f"{e}; pick another --weight-cache-health-port", 2) from e
        log.info("health on http://%s:%d/health", self.health_host, port)
