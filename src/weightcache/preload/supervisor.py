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
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..key import CacheKey
from ..sockets import daemon_sockets, parse_socket_name, probe
from .child import (
    ADOPT,
    EXIT_KEY_CHANGED,
    GO,
    LOAD,
    TERM_GRACE_S,
    Child,
    ChildSpec,
    _raise_terminated,
    _Terminated,
    child_main,
    dump_modules,
    exit_code_of,
)
from .custody import DEFAULT_HOLD_AFTER_EXIT_S, Custody
from .group import Group, default_key, stamp_of
from .layout import Placement
from .ready import failure_report, ready_line

log = logging.getLogger("weightcache.preload.supervisor")

FAIL_GRACE_S = 0.5  # after a first failure, collect other ranks failing at the same moment
MAX_FAILED_RESTARTS = 5  # consecutive replacements that died before ready: give up on that rank
RESTART_BACKOFF_MAX_S = 30.0
class StartError(Exception):
    """The start failed; `code` is the exit code to use."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Supervisor:
    def __init__(self, groups: list[Group], *, socket_dir: str | Path, health_host: str = "127.0.0.1",
                 health_port: int | None = None, start_timeout: float = 3600.0,
                 rendezvous_timeout: float = 600.0, log_level: int = logging.INFO, ready_stream=None,
                 custodian: bool = True, keep_on_stop: bool = False, restart: bool = True,
                 remember: dict | None = None, local_rendezvous: bool = False, digests: list | None = None,
                 hold_after_exit: float = DEFAULT_HOLD_AFTER_EXIT_S, scrub_interval: float = 0.0,
                 warm_engine: bool = False, warm_models: list[str] = (), status_details: bool = False):
        """``remember``: {"argv", "checkpoints", "options"} of the front end's command line; once READY the
        supervisor writes them with every rank's key into a record its own restart comes back from
        (``record.py``). ``local_rendezvous``: no daemon meets its peers through the rendezvous store (a
        restart from a record): on one node it is kept in process, without torch. ``hold_after_exit``: how long
        the custodian keeps this preload's caches once it is gone without an orderly stop. ``status_details``:
        /status and /metrics show pids and paths (http.build_app)."""
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
        self.status_details = status_details  # /status and /metrics show pids and paths
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
        self.custody = Custody(self.socket_dir, hold_after_exit)  # keeps the caches past their daemons
        self.hold_after_exit = hold_after_exit
        self.scrub_interval = scrub_interval  # each daemon re-hashes its weights this often (0: never)
        self.stopped_by_signal = False
        self._keys: dict[tuple[str, int], CacheKey] = {}  # (role, rank) -> the key agreed at start
        self.restarts: dict[tuple[str, int], int] = {}
        self._failed_restarts: dict[tuple[str, int], int] = {}
        self._pending: dict[int, float] = {}  # child index -> when to start its replacement
        self._retired: list[Child] = []  # replaced children, closed a round later (the HTTP thread may look)
        self.remember, self.local_rendezvous = remember, local_rendezvous
        self.digests = list(digests or [])  # (what, Future): checkpoint hashes running while the daemons start
        self.warm = None  # warm.service.WarmService with --warm-engine
        self.warm_engine = warm_engine
        self.warm_models = list(warm_models)  # model directories whose modules the warm interpreter imports too

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
            self.stopped_by_signal = True
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
        from ..sockets import ensure_private_dir
        from .rendezvous import Rendezvous

        ensure_private_dir(self.socket_dir)
        if self.health_port is not None:
            self._start_http()
        if self.use_custodian:
            self.custody.open()
        else:
            self.custody.note_leftovers()
        if self.warm_engine:
            from ..warm.service import WarmService

            self.warm = WarmService(self.socket_dir, models=self.warm_models)
            self.warm.start()
        for g in self.groups:
            rdv = Rendezvous(group=g.role, master_addr=g.master_addr, master_port=g.master_port,
                             nnodes=g.layout.nodes, node_rank=g.layout.this_node, timeout=self.rendezvous_timeout,
                             local=self.local_rendezvous or (g.layout.nodes == 1 and g.loads_alone and not g.master_port))
            self.rendezvous[g.role] = rdv
            g.master_port = rdv.start()
        n = sum(len(g.layout.local_placements()) for g in self.groups)
        log.info("node %d/%d: starting %d daemon(s) in %s (rendezvous ports %s)", self.node_rank, self.nnodes,
                 n, self.socket_dir, ", ".join(f"{g.role} {g.master_port}" for g in self.groups))
        early = {g.role: self._loads_early(g) for g in self.groups}
        for g in self.groups:
            if early[g.role]:
                log.info("%s: nothing held to take over: loading while the checkpoint is hashed", g.role)
            for p in g.layout.local_placements():
                self._spawn(g, p, load_early=early[g.role])
        self._await_digests()
        self._wait_for(lambda: all(c.state in ("started", "ready") for c in self.children), "to open its socket")
        self._prune()
        held = {g.role: self._held_here(g) for g in self.groups}
        go = {}
        for g in self.groups:
            if early[g.role]:  # loading already; what it deposited meanwhile stays held
                self._agree(g, None)
                go[g.role] = LOAD
                continue
            go[g.role] = GO if self._agree(g, held[g.role]) else LOAD
            if go[g.role] == LOAD and held[g.role] is not None:
                self.custody.release_partial(g.role, [Path(c.socket).name for c in self.children
                                                      if c.spec.role == g.role])
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
        self._write_record()
        dump_modules("supervisor")
        self._print_ready()

    def _await_digests(self) -> None:
        """The checkpoint hashes the front end started (the daemons wait for them to derive their keys)."""
        for what, fut in self.digests:
            try:
                fut.result(timeout=self.start_timeout)
            except OSError as e:
                raise StartError(f"{what}: {e}", 2) from None
            except TimeoutError:
                raise StartError(f"{what}: hashing the checkpoint took longer than the start timeout", 1) from None

    def _write_record(self) -> None:
        """What a restart of this very preload needs to come back without the engine (``record.py``)."""
        if self.remember is None or self.custody.client is None:
            return
        from . import record

        options = {"health_host": self.health_host, "health_port": self.health_port,
                   "hold_after_exit": self.hold_after_exit,
                   "start_timeout": self.start_timeout, "rendezvous_timeout": self.rendezvous_timeout,
                   "log_level": self.log_level, "keep_on_stop": self.keep_on_stop,
                   "scrub_interval": self.scrub_interval, "status_details": self.status_details,
                   "warm_engine": self.warm_engine, "warm_models": self.warm_models}
        record.write_for(self.remember, self.groups, self.children, socket_dir=self.socket_dir, options=options)

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
                self.custody.owned.add(Path(c.socket).name)
            if c.replacement:
                self._tend_replacement(c)
            if c.exited and not c.reported:
                c.reported = True
                self._on_exit(i, c)
        self._start_due_replacements()
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
            spec = dataclasses.replace(old.spec, expect_key=self._keys.get(slot), supervisor_pid=os.getpid(),
                                       load_early=False)
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

    @property
    def custodian(self):
        """Our connection to the custodian (custodian.client.CustodianClient), or None."""
        return self.custody.client

    def _prune(self) -> None:
        for g in self.groups:
            mine = [c for c in self.children if c.spec.role == g.role]
            self.custody.prune(g.role, mine[0].key.model, [Path(c.socket).name for c in mine])

    def _held_here(self, g: Group) -> bool | None:
        """Whether the custodian holds every local cache of the group (None: it holds none of them)."""
        return self.custody.holds({Path(c.socket).name for c in self.children if c.spec.role == g.role})

    def _release_held(self, failure: BaseException | None) -> None:
        self.custody.owned.update(Path(c.socket).name for c in self.children if c.socket)
        self.custody.finish(keep=failure is None and self.keep_on_stop and self.stopped_by_signal)

    def shutdown(self, failure: BaseException | None = None) -> None:
        for _, fut in self.digests:
            fut.cancel()
        from .rendezvous import RendezvousError

        if failure is not None and not isinstance(failure, RendezvousError):
            for rdv in self.rendezvous.values():
                rdv.fail(str(failure))
        self._pending.clear()
        self._terminate_children()
        self._release_held(failure)
        if self.warm is not None:
            self.warm.stop(keep=failure is None and self.keep_on_stop and self._stopped_by_signal)
        for rdv in self.rendezvous.values():
            rdv.close()
        if self.http is not None:
            self.http.stop()
            self.http = None

    # -- start-up ----------------------------------------------------------------------------------------

    def _loads_early(self, g: Group) -> bool:
        """Whether the group's daemons may load before their keys are made (while the checkpoint is hashed):
        on one node (no other node's caches to agree on), with nothing held by the custodian (nothing to take
        over) and no live daemon of the role in the socket directory (a second preload of the same model is
        refused before it loads)."""
        if g.layout.nodes != 1 or not self.custody.holds_nothing():
            return False
        for path in daemon_sockets(self.socket_dir):
            named = parse_socket_name(path.name)
            if named and named["role"] == g.role and probe(path) != "stale":
                return False
        return True

    def _spawn(self, g: Group, p: Placement, load_early: bool = False) -> None:
        spec = ChildSpec(role=g.role, placement=p, layout=g.layout.describe(), socket_dir=str(self.socket_dir),
                         make_source=g.make_source, source_args=dict(g.source_args),
                         make_key=g.make_key or default_key, key_args=dict(g.key_args),
                         supervisor_pid=os.getpid(), master_addr=g.master_addr,
                         master_port=g.master_port, info=dict(g.info), log_level=self.log_level,
                         custodian=self.custody.socket, custodian_token=self.custody.token,
                         loads_alone=g.loads_alone, gpu_uuid=g.gpu_uuids.get(p.rank, ""),
                         preimport=tuple(g.preimport), scrub_interval=self.scrub_interval, load_early=load_early)
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
                self.custody.owned.add(Path(c.socket).name)
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
        from ..key import diff

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
        message, code = failure_report(self.children, node_rank=self.node_rank, nnodes=self.nnodes)
        raise StartError(message, code)

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
        url = f"http://{self.health_host}:{self.http.port}/health" if self.http is not None else None
        print(ready_line(self.groups, self.children, node_rank=self.node_rank, nnodes=self.nnodes,
                         socket_dir=self.socket_dir, health_url=url), file=self.ready_stream or sys.stdout, flush=True)

    # -- HTTP --------------------------------------------------------------------------------------------

    def entries(self):
        """The local daemons as /health, /metrics and /status see them (asked over their sockets now)."""
        from .http import daemon_entries

        return daemon_entries(list(self.children), self.restarts)

    def info(self) -> dict:
        return {
            "node_rank": self.node_rank, "nnodes": self.nnodes, "ready": self.ready,
            "socket_dir": str(self.socket_dir), "custodian": self.custody.info(),
            "groups": [{"role": g.role, "layout": g.layout.describe(), "world_size": g.layout.world_size,
                        "master_port": g.master_port,
                        "cluster": self.rendezvous[g.role].cluster_state() if g.role in self.rendezvous else {}}
                       for g in self.groups],
        }

    def _start_http(self) -> None:
        from .http import HealthServer, build_app

        self.http = HealthServer(build_app(self.entries, self.info, self.custody.metrics,
                                           details=self.status_details), self.health_host, self.health_port)
        try:
            port = self.http.start()
        except (OSError, TimeoutError) as e:
            self.http = None
            raise StartError(f"{e}; pick another --weight-cache-health-port", 2) from e
        log.info("health on http://%s:%d/health", self.health_host, port)
